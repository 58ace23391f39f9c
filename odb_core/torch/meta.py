"""Step metadata carried in band, inside every yielded batch.

A trainer that prefetches batches (Lightning, HF Trainer, Accelerate) may have
pulled batch k+1 from the loader before it runs the step of batch k, so
`loader.step_info` (the last batch *yielded*) is not the batch being trained on.
So the loader puts each step's metadata into the batch itself, as one int64
tensor under `STEP_META_KEY` ("odb_step"); it moves with the batch (`.to(device)`,
Lightning's `apply_to_collection`, HF Trainer's `_prepare_inputs`, Accelerate's
`send_to_device`, `torch.utils._pytree`) and, being integers, is never cast by a
precision plugin.

    batch = next(it)                      # {"input_ids": ..., "labels": ..., "odb_step": tensor}
    meta = pop_step_meta(batch)           # StepMeta; the batch is collate_fn's output again
    out = model(**batch)
    loss = scaled_loss(meta, out.loss)    # or causal_lm_loss(meta, out.logits, batch["labels"])

A MutableMapping batch (dict, BatchEncoding) gets the key in place, an immutable
Mapping becomes a dict, and any other batch is yielded as the container
`{"batch": <collate_fn output>, "odb_step": <tensor>}`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from odb_core.config import LossNormalization
from odb_core.errors import ODBError
from odb_core.step import StepInfo, loss_scale

__all__ = [
    "BATCH_KEY",
    "STEP_META_KEY",
    "StepMeta",
    "causal_lm_loss",
    "pop_step_meta",
    "read_step_meta",
    "scaled_loss",
]

STEP_META_KEY = "odb_step"
BATCH_KEY = "batch"  # the container's key for a batch that is not a Mapping

_NORMS = (LossNormalization.TOKENS, LossNormalization.SAMPLES)
_CONTEXT = "_odb_context"  # (world_size, normalization) attached to a yielded StepInfo


class StepMeta(NamedTuple):
    """One step's metadata, as carried in band (all integers on the wire).

    `normalization`: 0 = per loss token, 1 = per sample (`LossNormalization`).
    Counts are real samples and loss tokens (labels not masked): `local_*` this
    rank's batch, `global_*` all ranks at this step, `window_*` all ranks over
    the step's whole optimizer window. `sync_gradients` is True on the window's
    last step (step the optimizer after its backward).
    """

    step: int
    window: int
    is_pad: bool
    sync_gradients: bool
    world_size: int
    normalization: int
    local_samples: int
    global_samples: int
    local_loss_tokens: int
    global_loss_tokens: int
    window_samples: int
    window_loss_tokens: int

    @property
    def loss_normalization(self) -> LossNormalization:
        return _NORMS[self.normalization]

    @property
    def loss_scale(self) -> float:
        """W * local / window (loss tokens or samples); 0 if either count is 0.
        The core's own formula (`odb_core.step.loss_scale`), so it equals
        `StepInfo.loss_scale` exactly."""
        return loss_scale(
            self.loss_normalization,
            self.world_size,
            (self.local_samples, self.local_loss_tokens),
            (self.window_samples, self.window_loss_tokens),
        )

    @property
    def loss_denominator(self) -> float:
        """What to divide this rank's *summed* loss by (the sum of its token cross-
        entropies, or of its samples' means) so that the ranks' average is the
        window's global mean: window_loss_tokens / W (window_samples / W), at least
        1 / W (a window without any is weighted 0 anyway; see `zero_if_unweighted`)."""
        tokens = self.loss_normalization is LossNormalization.TOKENS
        count = self.window_loss_tokens if tokens else self.window_samples
        return max(1, count) / self.world_size

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([int(v) for v in self], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> StepMeta:
        """Read the in-band tensor (on any device: one tiny copy to the host)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected the {STEP_META_KEY!r} tensor, got {type(tensor).__name__}")
        if tensor.numel() != len(cls._fields) or tensor.dtype.is_floating_point:
            raise ODBError(
                f"{STEP_META_KEY!r} tensor of shape {tuple(tensor.shape)} and dtype "
                f"{tensor.dtype}; expected {len(cls._fields)} integers (was it collated, "
                "cast or sliced by something between the loader and the step?)"
            )
        v = [int(x) for x in tensor.reshape(-1).tolist()]
        if v[5] not in (0, 1):
            raise ODBError(f"{STEP_META_KEY!r} tensor has normalization={v[5]}, expected 0 or 1")
        return cls(v[0], v[1], bool(v[2]), bool(v[3]), *v[4:])

    @classmethod
    def from_info(
        cls,
        info: StepInfo,
        world_size: int | None = None,
        normalization: LossNormalization | str | None = None,
    ) -> StepMeta:
        """The metadata of a final StepInfo. A StepInfo yielded by ODBDataLoader
        knows its world size and normalisation; any other needs them given."""
        context = getattr(info, "__dict__", {}).get(_CONTEXT)
        if world_size is None or normalization is None:
            if context is None:
                raise ODBError(
                    "this StepInfo was not yielded by an ODBDataLoader: pass world_size= and "
                    "normalization= to read its metadata"
                )
            world_size = context[0] if world_size is None else world_size
            normalization = context[1] if normalization is None else normalization
        norm = LossNormalization(getattr(normalization, "value", normalization))
        if not info.final:
            raise ODBError(
                f"step {info.step} is provisional (its window has not closed): only the "
                "StepInfos the loader yields (or WindowBuffer releases) carry metadata"
            )
        return cls(
            info.step,
            info.window,
            info.is_pad,
            info.sync_gradients,
            world_size,
            _NORMS.index(norm),
            info.local_samples,
            info.global_samples,
            info.local_loss_tokens,
            info.global_loss_tokens,
            info.window_samples,
            info.window_loss_tokens,
        )


def attach_context(info: StepInfo, world_size: int, normalization: LossNormalization) -> None:
    """Let `read_step_meta(info)` rebuild the metadata of a StepInfo the loader yields
    (StepInfo, a core type, has no world size or normalisation field)."""
    with contextlib.suppress(AttributeError):  # a slotted StepInfo: pass them explicitly
        object.__setattr__(info, _CONTEXT, (world_size, normalization))


def with_meta(batch: Any, meta: torch.Tensor) -> Any:
    """The batch with its metadata in band (see the module docstring)."""
    if isinstance(batch, MutableMapping):
        if STEP_META_KEY in batch:
            raise ODBError(
                f"collate_fn returned a batch that already has the key {STEP_META_KEY!r}, where "
                "the loader puts the step metadata; rename it or pass step_meta=False"
            )
        batch[STEP_META_KEY] = meta
        return batch
    if isinstance(batch, Mapping):
        if STEP_META_KEY in batch:
            raise ODBError(
                f"collate_fn returned a batch that already has the key {STEP_META_KEY!r}; "
                "rename it or pass step_meta=False"
            )
        return {**batch, STEP_META_KEY: meta}
    return {BATCH_KEY: batch, STEP_META_KEY: meta}


def read_step_meta(
    x: Any,
    *,
    world_size: int | None = None,
    normalization: LossNormalization | str | None = None,
) -> StepMeta:
    """The StepMeta of a yielded batch (read, not removed), of its `odb_step`
    tensor, of a StepInfo the loader yielded, or a StepMeta itself."""
    if isinstance(x, StepMeta):
        return x
    if isinstance(x, torch.Tensor):
        return StepMeta.from_tensor(x)
    if isinstance(x, StepInfo):
        return StepMeta.from_info(x, world_size, normalization)
    if isinstance(x, Mapping):
        if STEP_META_KEY not in x:
            raise ODBError(
                f"the batch has no {STEP_META_KEY!r} key (keys: {sorted(map(str, x))}): the "
                "loader was built with step_meta=False, or pop_step_meta already removed it"
            )
        return StepMeta.from_tensor(x[STEP_META_KEY])
    raise TypeError(
        "read_step_meta() takes a batch yielded by ODBDataLoader, its 'odb_step' tensor, a "
        f"StepInfo or a StepMeta, not {type(x).__name__}"
    )


def step_meta(x: Any, **context: Any) -> StepMeta:
    """Deprecated name of `read_step_meta` (`step_meta=` is the loader's option)."""
    warnings.warn(
        "odb_core.step_meta(batch) is deprecated: use odb_core.read_step_meta(batch) "
        "(step_meta= stays the loader's option)",
        DeprecationWarning,
        stacklevel=2,
    )
    return read_step_meta(x, **context)


def pop_step_meta(batch: MutableMapping[str, Any]) -> StepMeta:
    """Remove the metadata from a yielded batch and return it, so that the batch is
    `collate_fn`'s output again (`model(**batch)` works). On an accelerator, reading
    it costs one copy of 12 integers to the host; pop it before moving the batch
    when you control the move."""
    if not isinstance(batch, MutableMapping):
        raise TypeError(
            f"pop_step_meta() takes a yielded batch (a mutable mapping), not "
            f"{type(batch).__name__}; use read_step_meta() to read without removing"
        )
    if STEP_META_KEY not in batch:
        read_step_meta(batch)  # raises, naming the keys
    return StepMeta.from_tensor(batch.pop(STEP_META_KEY))


def scaled_loss(meta_or_batch: Any, loss: torch.Tensor) -> torch.Tensor:
    """`loss * loss_scale`, with `loss` this rank's mean over its loss tokens (its
    samples, with normalization 'samples'), e.g. an HF model's `.loss`. Summed over
    the window's steps and averaged over the ranks by DDP/FSDP, the gradient is
    exactly that of the global mean over the window. A step with scale 0 (a pad,
    a batch without loss tokens, a window without any) gives 0 with the graph
    kept, even when its mean is NaN (a mean over no token)."""
    return apply_scale(loss, read_step_meta(meta_or_batch).loss_scale)


def apply_scale(loss: torch.Tensor, scale: float) -> torch.Tensor:
    """`loss * scale`; for scale 0, 0 with the graph kept even for a NaN loss."""
    if scale == 0.0:
        return torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
    return loss * scale


def zero_if_unweighted(meta_or_batch: Any, loss: torch.Tensor) -> torch.Tensor:
    """`loss` unchanged, or 0 with the graph kept (also for a NaN loss) on a step whose
    loss scale is 0 (a pad, a batch without loss tokens): for a loss already divided
    by `StepMeta.loss_denominator`, the pad-step rule of `scaled_loss`."""
    if read_step_meta(meta_or_batch).loss_scale == 0.0:
        return apply_scale(loss, 0.0)
    return loss


def causal_lm_loss(
    meta_or_batch: Any,
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    shift: bool = True,
    ignore_index: int = -100,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step's share of the window's global mean loss, from logits and labels.

    tokens:  sum of the token cross-entropies x W / window_loss_tokens
    samples: sum over the batch's samples of each sample's mean x W / window_samples
             (logits [B, L, V]; one sample per row, or, given the `position_ids`
             of packed rows (`pack_collate`), one per position run from 0)

    `shift=True` predicts token t+1 at position t (labels aligned with input_ids,
    as HF models take them; the loader's default `label_shift=1` counts the same
    tokens). The reduction runs in float64; the result is float32 (or the logits'
    dtype if wider). A pad step, or a window with no loss token, gives 0 x the
    sum, which keeps the graph, so DDP/FSDP still run their collectives.
    """
    meta = read_step_meta(meta_or_batch)
    if shift:
        logits = logits[..., :-1, :]
        labels = labels[..., 1:]
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match labels of shape "
            f"{tuple(labels.shape)} (after shift={shift})"
        )
    out_dtype = torch.promote_types(logits.dtype, torch.float32)
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(out_dtype),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
    ).double()
    if meta.loss_normalization is LossNormalization.TOKENS:
        total, denom = per_token.sum(), meta.window_loss_tokens
    else:
        width = labels.shape[-1]
        valid = (labels != ignore_index).reshape(-1, width)
        if position_ids is None:
            sums, counts = per_token.reshape(-1, width).sum(-1), valid.sum(-1)
        else:
            seg = _segment_index(position_ids, labels.shape, shift)
            n = int(seg.max()) + 1 if seg.numel() else 0
            sums = per_token.new_zeros(n).index_add_(0, seg, per_token)
            counts = valid.new_zeros(n, dtype=torch.long).index_add_(
                0, seg, valid.reshape(-1).long()
            )
        total = (sums / counts.clamp(min=1)).sum()
        denom = meta.window_samples
    if meta.is_pad or denom == 0:
        return (total * 0.0).to(out_dtype)
    return (total * (meta.world_size / denom)).to(out_dtype)


def _segment_index(
    position_ids: torch.Tensor, label_shape: torch.Size, shift: bool
) -> torch.Tensor:
    """For each (shifted) label, the index of its sample over the whole batch: a
    sample starts at each row start and wherever `pos[t] != pos[t-1] + 1`."""
    pos = position_ids.reshape(-1, position_ids.shape[-1]).to(torch.long)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    seg = starts.reshape(-1).cumsum(0).reshape(pos.shape) - 1
    if shift:
        seg = seg[:, 1:]
    if seg.numel() != label_shape.numel():
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} do not match labels of shape "
            f"{tuple(label_shape)} (after shift={shift})"
        )
    return seg.reshape(-1).to(position_ids.device)
