"""What a trainer sizes a run of whole epochs from, as the loader states it: the
optimizer updates of its step estimates and a per-epoch cap no epoch reaches. One
computation for every adapter (the HF Trainer's loop and schedule, Lightning's
`estimated_stepping_batches`, a progress bar's total)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from odb_core.estimate import StepsEstimate

if TYPE_CHECKING:
    from odb_core.torch.loader import ODBDataLoader

__all__ = ["UpdatesPlan", "updates_plan"]


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
