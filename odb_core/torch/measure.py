"""A processed sample's cost as the protocol sees it, its loss tokens, and
truncation of its data.

Default cost: `len(sample["input_ids"])` tokens in all, visual tokens counted once.
`input_ids` already holds a sample's visual tokens (every transformers VLM
processor, Qwen-VL's included, expands each image placeholder into the image's
tokens), so a `sample["visual_tokens"]` (an int or a sequence, whose length
counts) is the part of `input_ids` that images take, never added on top: the
Sample gets `tokens = len(input_ids) - visual_tokens` and `visual_tokens` (the
split the Multimodal cost model weighs), and a `visual_tokens` above
`len(input_ids)` is refused. `sample["patches"]` is read when present. A user
`cost_fn(sample)` returns `tokens` or `(tokens, visual_tokens[, patches])`, text
and visual apart (for a model that expands images only in its forward).

Truncation (`oversize="truncate"`, `default_truncate`) cuts text fields only; it
refuses a sample with images or videos (`VISUAL_KEYS` or `visual_tokens`), whose
cut `input_ids` would no longer match its `pixel_values`.

Loss tokens (the tokens whose loss counts, which the loss normalisation divides
by) are measured apart from the cost: by default, for a mapping with `labels`,
the count of `labels[label_shift:] != ignore_index` (a causal LM shifts its
labels by one, so the first label never counts); without `labels`, None (every
text token counts). `loss_tokens_fn(sample)` overrides it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from odb_core.errors import SampleError
from odb_core.sample import Sample, make_sample

CostFn = Callable[[Any], object]
TruncateFn = Callable[[Any, int], Any]
LossTokensFn = Callable[[Any], object]

_FIELD = "input_ids"
_LABELS = "labels"
#: Sample fields holding images or videos and their grids (transformers' VLM processors).
VISUAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


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
    visual = visual if visual == 0 else _length(visual)
    patches = sample.get("patches", 0)
    if visual != 0 and type(tokens) is int and type(visual) is int:
        if visual > tokens:
            raise SampleError(
                f"sample {sample_id}: visual_tokens={visual} but {_FIELD} has {tokens} tokens; "
                f"the default cost counts visual tokens inside {_FIELD} (as transformers' VLM "
                "processors expand them): pass cost_fn= returning (text_tokens, visual_tokens) "
                "if your images are expanded only in the model's forward"
            )
        tokens -= visual
    return tokens, visual, patches if patches == 0 else _length(patches)


class LossTokens:
    """How a sample's loss tokens are counted (picklable; see the module docstring)."""

    def __init__(
        self, fn: LossTokensFn | None = None, label_shift: int = 1, ignore_index: int = -100
    ) -> None:
        self.fn = fn
        self.label_shift = label_shift
        self.ignore_index = ignore_index
        self._looked = 0  # samples checked for labels already shifted

    def __call__(self, sample: object, sample_id: int) -> int | None:
        if self.fn is not None:
            try:
                value = self.fn(sample)
            except SampleError:
                raise
            except Exception as exc:
                raise SampleError(f"sample {sample_id}: loss_tokens_fn raised {exc!r}") from exc
            if value is None:
                return None
            return make_sample(sample_id, 0, loss_tokens=value).loss_tokens
        if not isinstance(sample, Mapping) or _LABELS not in sample:
            return None
        labels = sample[_LABELS]
        if _FIELD in sample:
            n_labels, n_ids = _length(labels), _length(sample[_FIELD])
            if n_labels != n_ids:
                raise SampleError(
                    f"sample {sample_id}: {_LABELS} has length {n_labels!r} but {_FIELD} has "
                    f"length {n_ids!r}; they must align token for token (pass "
                    "loss_tokens_fn= for another layout)"
                )
            if self.label_shift == 1 and self._looked < _SHIFT_LOOKS:
                self._looked += 1
                _warn_if_shifted(labels, sample[_FIELD], self.ignore_index, sample_id)
        return count_loss_tokens(labels, self.label_shift, self.ignore_index, sample_id)


_SHIFT_LOOKS = 8  # samples per loader (per worker) checked for labels already shifted
_shift_warned = False


def _flat(value: object) -> list[object] | None:
    tolist = getattr(value, "tolist", None)
    out = tolist() if callable(tolist) else value
    if isinstance(out, (list, tuple)) and len(out) == 1 and isinstance(out[0], (list, tuple)):
        out = out[0]
    return list(out) if isinstance(out, (list, tuple)) else None


def _warn_if_shifted(labels: object, input_ids: object, ignore_index: int, sample_id: int) -> None:
    """Warn once when `labels` are visibly `input_ids` shifted by one (labels[t] ==
    input_ids[t + 1] wherever a label counts) under label_shift=1: the loader would
    not count the first label, one loss token per sample lost from the denominator."""
    global _shift_warned
    if _shift_warned:
        return
    lab, ids = _flat(labels), _flat(input_ids)
    if lab is None or ids is None or len(lab) != len(ids):
        return
    kept = [t for t in range(len(lab) - 1) if lab[t] != ignore_index]
    if len(kept) < 4 or lab[len(lab) - 1] != ignore_index:
        return
    shifted = all(lab[t] == ids[t + 1] for t in kept)
    aligned = all(lab[t] == ids[t] for t in kept)
    if shifted and not aligned:
        _shift_warned = True
        warnings.warn(
            f"sample {sample_id}: labels look already shifted (labels[t] == input_ids[t + 1], "
            "the last label masked) but the loader counts loss tokens with label_shift=1, "
            "which drops the first label of every sample from the loss denominator: pass "
            "label_shift=0 for labels shifted by your own code",
            UserWarning,
            stacklevel=2,
        )


def count_loss_tokens(labels: object, shift: int, ignore_index: int, sample_id: int) -> int:
    """`labels[shift:] != ignore_index`, counted along the last axis; labels may be a
    tensor ([L] or [1, L]), a numpy array or a sequence of ints."""
    ne = getattr(labels, "ne", None)  # torch tensors
    if callable(ne) and hasattr(labels, "shape"):
        return int(labels[..., shift:].ne(ignore_index).sum().item())  # type: ignore[index]
    if hasattr(labels, "shape") and hasattr(labels, "sum"):  # numpy arrays
        return int((labels[..., shift:] != ignore_index).sum())  # type: ignore[index]
    if isinstance(labels, (list, tuple)):
        if labels and isinstance(labels[0], (list, tuple)):  # [[...]]: one row
            return sum(count_loss_tokens(row, shift, ignore_index, sample_id) for row in labels)
        return sum(1 for x in labels[shift:] if x != ignore_index)
    raise SampleError(
        f"sample {sample_id}: cannot count the loss tokens of labels of type "
        f"{type(labels).__name__}; pass loss_tokens_fn="
    )


def measure(
    sample: object,
    sample_id: int,
    cost_fn: CostFn | None,
    loss_tokens: LossTokens | None = None,
) -> Sample:
    """The validated Sample of a processed sample; SampleError names id and value."""
    loss = None if loss_tokens is None else loss_tokens(sample, sample_id)
    s = _measure_cost(sample, sample_id, cost_fn)
    return s if loss is None else s._replace(loss_tokens=loss)


def _measure_cost(sample: object, sample_id: int, cost_fn: CostFn | None) -> Sample:
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
        return make_sample(sample_id, *tuple(cost)[1:])
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
    (input_ids, labels, attention_mask, ...); used by the `truncate` oversize policy.
    Refuses a sample with images or videos: the cut would separate image tokens
    from the `pixel_values` they refer to."""
    if not isinstance(sample, Mapping):
        raise SampleError(
            f"sample {sample_id}: oversize='truncate' needs truncate_fn= for a "
            f"{type(sample).__name__} sample"
        )
    visual = [
        k
        for k in (*VISUAL_KEYS, "visual_tokens")
        if sample.get(k) is not None and not (type(sample.get(k)) is int and sample[k] == 0)
    ]
    if visual:
        raise SampleError(
            f"sample {sample_id}: oversize='truncate' would cut its input_ids to {keep} of "
            f"{original} text tokens apart from its {', '.join(visual)} (image tokens and "
            "pixels must stay together): raise token_budget or max_pixels, use "
            "oversize='solo' or 'error', or pass truncate_fn= that drops whole images"
        )
    out = dict(sample)
    for key, value in sample.items():
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) > 0 and shape[-1] == original:
            out[key] = value[..., :keep]
        elif isinstance(value, (list, tuple)) and len(value) == original:
            out[key] = value[:keep]
    return out
