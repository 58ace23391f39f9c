"""A processed sample's cost as the protocol sees it, and truncation of its data.

Default cost: `len(sample["input_ids"])` text tokens, plus `sample["visual_tokens"]`
and `sample["patches"]` when present (an int or a sequence, whose length counts).
A user `cost_fn(sample)` returns `tokens` or `(tokens, visual_tokens[, patches])`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from odb_core.errors import SampleError
from odb_core.sample import Sample, make_sample

CostFn = Callable[[Any], object]
TruncateFn = Callable[[Any, int], Any]

_FIELD = "input_ids"


def _length(value: object) -> object:
    if isinstance(value, list):
        return len(value)
    numel = getattr(value, "numel", None)
    if callable(numel):  # tensors; a [1, L] tensor counts L tokens
        return numel()
    size = getattr(value, "size", None)
    if isinstance(size, int) and hasattr(value, "shape"):  # numpy arrays
        return size
    if isinstance(value, (list, tuple, str, bytes)):
        return len(value)
    return value


def default_cost(sample: object, sample_id: int) -> tuple[object, object, object]:
    if not isinstance(sample, Mapping):
        raise SampleError(
            f"sample {sample_id}: the default cost reads sample[{_FIELD!r}], but the sample is "
            f"a {type(sample).__name__}; return a dict or pass cost_fn="
        )
    if _FIELD not in sample:
        raise SampleError(
            f"sample {sample_id}: no {_FIELD!r} field to measure its cost (fields: "
            f"{sorted(map(str, sample))}); pass cost_fn= to measure it another way"
        )
    ids = sample[_FIELD]
    tokens = _length(ids)
    if tokens is ids and not isinstance(ids, (int, float)):
        raise SampleError(
            f"sample {sample_id}: {_FIELD}={type(ids).__name__} has no length; "
            "pass cost_fn= to measure it"
        )
    visual = sample.get("visual_tokens", 0)
    patches = sample.get("patches", 0)
    return (
        tokens,
        visual if visual == 0 else _length(visual),
        patches if patches == 0 else _length(patches),
    )


def measure(sample: object, sample_id: int, cost_fn: CostFn | None) -> Sample:
    """The validated Sample of a processed sample; SampleError names id and value."""
    if cost_fn is None:
        t, v, p = default_cost(sample, sample_id)
        if type(t) is int and type(v) is int and type(p) is int and min(t, v, p) >= 0:
            return Sample(sample_id, t, v, p)  # what make_sample returns, minus re-checks
        return make_sample(sample_id, t, v, p)
    try:
        cost = cost_fn(sample)
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(f"sample {sample_id}: cost_fn raised {exc!r}") from exc
    if isinstance(cost, Sample):
        cost = tuple(cost)[1:]
    if isinstance(cost, tuple):
        if not 1 <= len(cost) <= 3:
            raise SampleError(
                f"sample {sample_id}: cost_fn returned {cost!r}; expected tokens or "
                "(tokens, visual_tokens[, patches])"
            )
        return make_sample(sample_id, *cost)
    return make_sample(sample_id, cost)


def default_truncate(sample: Any, keep: int, original: int, sample_id: int) -> Any:
    """Cut every field whose length is the sample's text length to `keep` tokens
    (input_ids, labels, attention_mask, ...); used by the `truncate` oversize policy."""
    if not isinstance(sample, Mapping):
        raise SampleError(
            f"sample {sample_id}: oversize='truncate' needs truncate_fn= for a "
            f"{type(sample).__name__} sample"
        )
    out = dict(sample)
    for key, value in sample.items():
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) > 0 and shape[-1] == original:
            out[key] = value[..., :keep]
        elif isinstance(value, (list, tuple)) and len(value) == original:
            out[key] = value[:keep]
    return out
