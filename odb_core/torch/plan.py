"""What a trainer sizes a run of whole epochs from, as the loader states it: the
optimizer updates of its step estimates and a per-epoch cap no epoch reaches. One
computation for every adapter (the HF Trainer's loop and schedule, Lightning's
`estimated_stepping_batches`, a progress bar's total), and the updates a run has
left from the loader's position (`updates_left`: a resume at another world size
replans the rest of the run)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from odb_core.config import Mode
from odb_core.errors import ConfigError
from odb_core.estimate import StepsEstimate, estimate_epoch_steps
from odb_core.progress import RunProgress
from odb_core.torch.length import shard_sizes

if TYPE_CHECKING:
    from odb_core.torch.loader import ODBDataLoader

__all__ = ["UpdatesPlan", "updates_left", "updates_plan"]


@dataclass(frozen=True)
class UpdatesPlan:
    """The updates (optimizer steps) of a run of `epochs` epochs, estimated.

    - `upper`: from the loader's upper estimate of an epoch's steps, for a schedule
      that must not end before the run does;
    - `planned`: from the estimate made before any epoch (`planned_steps()`), the
      same for the whole run, for a progress total;
    - `epoch_cap`: updates no epoch reaches (one step per sample), for a trainer
      loop that needs a per-epoch cap; the epoch ends with the loader's;
    - `samples`: the dataset's samples (an epoch's, for a trainer's log), and
      `samples_per_update`: what an optimizer update takes under the estimate.
    """

    epochs: int
    estimate: StepsEstimate  # of the current (or next) epoch's steps
    upper: int
    planned: int
    epoch_cap: int
    samples: int = 0
    samples_per_update: int = 1

    def describe(self, schedule: int) -> str:
        """One log line: the estimate, and a schedule of `schedule` updates."""
        e = self.estimate
        return (
            f"odb: an epoch is estimated at {e.steps} steps (upper {e.upper}; {e.basis}); LR "
            f"schedule and progress bar sized to {schedule} optimizer steps; the trainer's "
            f"step cap ({self.epoch_cap} per epoch) is out of reach, epochs end with the loader's"
        )


def updates_plan(loader: ODBDataLoader, epochs: int) -> UpdatesPlan | None:
    """The plan of `epochs` epochs over `loader`; None when the loader has no
    estimate (an IterableDataset: its size is unknown before it ends)."""
    bound = loader.step_bound()
    if bound is None:
        return None
    try:
        estimate = loader.steps_estimate()
    except TypeError:
        return None
    per_epoch = loader.optimizer_steps
    samples = len(loader.dataset)
    window = loader.config.grad_accum_steps or 1
    return UpdatesPlan(
        epochs=epochs,
        estimate=estimate,
        upper=epochs * per_epoch(estimate.upper),
        planned=epochs * per_epoch(loader.planned_steps().steps),
        epoch_cap=per_epoch(bound) + 1,
        samples=samples,
        samples_per_update=max(1, round(samples * window / max(1, estimate.steps))),
    )


def updates_left(loader: ODBDataLoader, epochs: int) -> int | None:
    """The loader's upper estimate of the optimizer updates the rest of a run of
    `epochs` epochs needs, from its position (`run_progress`; a loaded state not
    yet iterated is its position) at its world size: the current epoch's samples
    not yet consumed, formed by the core's estimator (`estimate_epoch_steps`) on
    shard sizes of what is left at this world size, then each whole epoch left
    at the epoch's upper estimate. None when the loader has no estimate (an
    IterableDataset). Take the position at a window boundary (a checkpoint's):
    the windows left are then the steps left over `grad_accum_steps`.

    After a resume at another world size, updates done + this is the run's
    planned total at the new world size (`UpdatesPlan.upper` is a whole run's)."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ConfigError(f"epochs={epochs!r} must be a positive integer")
    if loader.step_bound() is None:
        return None
    try:
        full = loader.steps_estimate()
    except TypeError:
        return None
    progress = loader.run_progress
    per_epoch = loader.optimizer_steps(full.upper)
    if progress.epoch >= epochs:
        return 0
    whole = epochs - progress.epoch - 1
    if progress.closed:
        return whole * per_epoch
    if progress.samples <= 0 or progress.epoch_samples <= 0:
        return (whole + 1) * per_epoch
    left = max(0, progress.epoch_samples - progress.samples)
    return whole * per_epoch + loader.optimizer_steps(_steps_for(loader, left, full, progress))


def _steps_for(loader: ODBDataLoader, left: int, full: StepsEstimate, progress: RunProgress) -> int:
    """The upper estimate of the steps that form `left` samples of the epoch."""
    if left == 0:
        return 0
    config = loader.config
    costs = loader.measured_samples  # those `steps_estimate()` drew: not measured twice
    if config.mode is Mode.JOIN and costs:
        part = estimate_epoch_steps(config, costs, shard_sizes(left, loader.world_size))
        return min(part.upper, full.upper)  # a part of an epoch: not above the whole
    # quota mode (or no measured costs): the epoch's upper estimate, pro rata
    return min(full.upper, math.ceil(full.upper * left / progress.epoch_samples) + 1)
