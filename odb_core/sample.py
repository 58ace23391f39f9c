"""The unit the protocol batches: an observed sample with its identity and real token cost."""

from __future__ import annotations

import math
from typing import NamedTuple

from odb_core.errors import SampleError


class Sample(NamedTuple):
    """One preprocessed sample as the batcher observes it.

    `tokens` are text tokens, `visual_tokens` the tokens images or video add after
    expansion, `patches` the visual patches (for a per-batch patch cap). All are
    observed after preprocessing, so no length cache is needed.

    `loss_tokens` are the tokens whose loss counts (labels not masked), which the
    loss normalisation divides by; the budget never sees them. None means every
    text token counts (a sample without labels); `loss` resolves it.
    """

    id: int
    tokens: int
    visual_tokens: int = 0
    patches: int = 0
    loss_tokens: int | None = None

    @property
    def loss(self) -> int:
        """Tokens whose loss counts: `loss_tokens`, or the text tokens when unset."""
        return self.tokens if self.loss_tokens is None else self.loss_tokens

    @property
    def length(self) -> int:
        """Sequence length the accelerator sees: text plus visual tokens."""
        return self.tokens + self.visual_tokens


def _check_count(sample_id: object, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        raise SampleError(f"sample {sample_id!r}: {field}={value!r} is not an integer token count")
    if value < 0:
        raise SampleError(f"sample {sample_id!r}: {field}={value!r} is negative")
    return value


def make_sample(
    sample_id: object,
    tokens: object,
    visual_tokens: object = 0,
    patches: object = 0,
    loss_tokens: object = None,
) -> Sample:
    """Validate and build a Sample; raises SampleError naming the bad value.

    Accepts integral floats (e.g. 12.0) and numpy integers; rejects NaN, infinities,
    fractions, negatives and booleans.
    """
    if isinstance(sample_id, bool) or not isinstance(sample_id, int):
        try:
            as_int = int(sample_id)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise SampleError(f"sample id {sample_id!r} is not an integer") from None
        if as_int != sample_id:
            raise SampleError(f"sample id {sample_id!r} is not an integer")
        sample_id = as_int
    assert isinstance(sample_id, int)
    return Sample(
        sample_id,
        _check_count(sample_id, "tokens", _as_number(tokens)),
        _check_count(sample_id, "visual_tokens", _as_number(visual_tokens)),
        _check_count(sample_id, "patches", _as_number(patches)),
        None
        if loss_tokens is None
        else _check_count(sample_id, "loss_tokens", _as_number(loss_tokens)),
    )


def _as_number(value: object) -> object:
    # numpy scalars expose .item(); convert so the int/float checks above apply.
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (int, float)):
        try:
            return item()
        except (TypeError, ValueError):
            return value
    return value
