"""A decided training step (`StepInfo`) and its loss scale: what every rank's
training loop knows about the batch it was just given. Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass

from odb_core.batch import Batch
from odb_core.config import LossNormalization


@dataclass(frozen=True)
class StepInfo:
    """Everything a training step needs to know about the batch just yielded.

    Counts are `local` (this rank's batch) and `global` (all ranks at this step):
    real samples, cost tokens (what the budget bounds) and loss tokens (the
    tokens whose loss counts). `window` numbers the optimizer window the step
    belongs to; `sync_gradients` is True on the window's last step (step the
    optimizer after its backward); `window_samples` and `window_loss_tokens` are
    the window's global totals, which `loss_scale` normalises by:

        loss_scale = W * local_loss_tokens / window_loss_tokens   (tokens)
        loss_scale = W * local_samples / window_samples           (samples)

    and 0 when either count is 0 (a pad step, a step of fully masked labels, or a
    window without a single loss token). A rank's mean loss over its batch times
    `loss_scale`, summed over the window's steps and averaged over the W ranks by
    DDP/FSDP, is exactly the global per-token (per-sample) mean over the window.

    The window fields are final only once the window has closed: `RankMachine`
    emits steps as they are decided, with `loss_scale` NaN and window totals 0,
    and `WindowBuffer` releases them, final, when their window closes. Everything
    a training loop sees (the loader, `loader.step_info`) is final.
    """

    step: int
    rank: int
    round: int
    is_pad: bool
    batch: Batch | None
    local_samples: int
    global_samples: int
    local_tokens: int
    global_tokens: int
    local_loss_tokens: int = 0
    global_loss_tokens: int = 0
    window: int = 0
    sync_gradients: bool = True
    window_samples: int = 0
    window_loss_tokens: int = 0
    loss_scale: float = math.nan
    truncated: tuple[tuple[int, int], ...] = ()

    @property
    def sample_ids(self) -> tuple[int, ...]:
        return () if self.batch is None else self.batch.ids

    @property
    def final(self) -> bool:
        """The window fields and the loss scale are known (the window has closed)."""
        return not math.isnan(self.loss_scale)


def loss_scale(
    norm: LossNormalization,
    world: int,
    local: tuple[int, int],
    window: tuple[int, int],
) -> float:
    """W * local / window for (samples, loss tokens) pairs, by `norm`; 0 if either is 0.

    DDP/FSDP average gradients over W ranks, so a local mean loss times this,
    summed over the window's steps, is exactly the global per-token (or
    per-sample) mean over the window.
    """
    idx = 1 if norm is LossNormalization.TOKENS else 0
    if window[idx] == 0 or local[idx] == 0:
        return 0.0
    return world * local[idx] / window[idx]
