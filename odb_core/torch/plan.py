"""What a trainer sizes a run of whole epochs from, as the loader states it: the
optimizer updates of its step estimates and a per-epoch cap no epoch reaches. One
computation for every adapter (the HF Trainer's loop and schedule, Lightning's
`estimated_stepping_batches`, a progress bar's total), the updates a run has
left from the loader's position (`updates_left`: a resume at another world size
replans the rest of the run), and the run's plan a checkpoint keeps (`RunPlan`,
its one resume rule `resumed_figures`), for the HF and Lightning adapters alike."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from odb_core.config import Mode
from odb_core.errors import ConfigError, ResumeStateError
from odb_core.estimate import StepsEstimate, estimate_epoch_steps
from odb_core.progress import RunProgress
from odb_core.torch.length import shard_sizes

if TYPE_CHECKING:
    from odb_core.torch.loader import ODBDataLoader

__all__ = [
    "RunFigures",
    "RunPlan",
    "UpdatesPlan",
    "resumed_figures",
    "updates_left",
    "updates_plan",
]


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


# ---- the run's plan in a checkpoint, and the one resume rule -----------------------------


@dataclass(frozen=True)
class RunPlan:
    """The run's plan of optimizer updates as a checkpoint keeps it (the HF adapter
    in its `odb_trainer.json`, Lightning's DataModule in its state entry).

    What the figures were planned for: `world_size`, `epochs` (the run's epochs as
    the trainer states them; None for a run sized by `max_steps`) and `max_steps`
    (-1 or 0: none); `updates`: the optimizer updates done when it was saved. The
    figures, in updates at `world_size` (None where the trainer had none): `total`,
    the upper one a step-sized schedule was sized to (the HF schedule's length,
    Lightning's `estimated_stepping_batches`); `planned`, the central one (a
    progress total). `warmup_base`: the planned updates a progress schedule's
    warmup given in updates was converted against when the run started (the HF
    adapter's `warmup_steps`): a fraction of the run's progress, which no world
    size changes.

    `from_dict` reads one from disk, as untrusted input; `resumed_figures` is what
    a resume makes of it."""

    world_size: int
    epochs: int | None
    max_steps: int
    updates: int
    total: int | None
    planned: int | None = None
    warmup_base: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def same_run(self, world_size: int, epochs: int | None, max_steps: int) -> bool:
        """The resumed run is the one this plan was made for."""
        return (self.world_size, self.epochs, self.max_steps) == (world_size, epochs, max_steps)

    @classmethod
    def from_dict(cls, value: Any, where: str) -> RunPlan | None:
        """The plan `value` (read from disk: checked, `ResumeStateError` naming the bad
        value and `where` it came from). None when there is none (saved by an older
        odb-core; the HF adapter's earlier file, which held no updates done, too)."""
        if value is None or (isinstance(value, Mapping) and set(value) == _OLD_HF_FIELDS):
            return None
        if isinstance(value, Mapping) and set(value) == set(_OLD_LIGHTNING_FIELDS):
            old = {_OLD_LIGHTNING_FIELDS[k]: v for k, v in value.items()}
            value = {**old, "planned": None, "warmup_base": None}
        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(value, Mapping) or set(value) != set(fields):
            raise ResumeStateError(
                f"the checkpoint's {where!r} is {value!r}; expected a mapping with exactly "
                f"the keys {fields}"
            )
        for key, low, optional in _BOUNDS:
            v = value[key]
            if v is None and optional:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ResumeStateError(
                    f"the checkpoint's {where!r} has {key}={v!r}; expected an integer >= {low}"
                    + (" or None" if optional else "")
                )
        return cls(**value)


#: Each field's lowest value and whether it may be None.
_BOUNDS = (
    ("world_size", 1, False),
    ("epochs", -1, True),
    ("max_steps", -1, False),
    ("updates", 0, False),
    ("total", 1, True),
    ("planned", 1, True),
    ("warmup_base", 1, True),
)
#: The plan Lightning's DataModule saved before `RunPlan` (its key -> the field).
_OLD_LIGHTNING_FIELDS = {
    "world_size": "world_size",
    "max_epochs": "epochs",
    "max_steps": "max_steps",
    "updates": "updates",
    "total": "total",
}
#: The HF adapter's file before `RunPlan`: no updates done, so nothing to resume from.
_OLD_HF_FIELDS = frozenset(
    (
        "schedule_steps",
        "planned_updates",
        "num_train_epochs",
        "world_size",
        "gradient_accumulation_steps",
    )
)


@dataclass(frozen=True)
class RunFigures:
    """What a run is sized to after `resumed_figures`: `total` (upper: a step-sized
    schedule's length), `planned` (central: a progress total), `warmup_base` (see
    `RunPlan`); `replanned`: the checkpoint's plan, when it was made for another
    run and the figures are its updates done + `left` (the loader's upper estimate
    of the updates the rest of the run needs here)."""

    total: int
    planned: int
    warmup_base: int
    replanned: RunPlan | None = None
    left: int = 0

    def replanned_as(self, figure: str, world_size: int, epochs: int | None) -> str:
        """What a replan made of `figure` (a trainer's name for `total`), for a log
        or a warning."""
        saved = self.replanned
        assert saved is not None
        return (
            f"resumed at world size {world_size} (epochs {epochs}) from a checkpoint taken at "
            f"world size {saved.world_size} (epochs {saved.epochs}): {figure} is now "
            f"{saved.updates} updates done + {self.left} left = {self.total}, not the run's "
            f"{saved.total}"
        )


def resumed_figures(
    plan: UpdatesPlan,
    saved: RunPlan | None,
    *,
    world_size: int,
    epochs: int | None,
    max_steps: int,
    left: Callable[[], int | None],
) -> RunFigures:
    """The one resume rule of the run's figures, for every adapter. A fresh run
    (`saved` None): the plan's. The same run (`saved.same_run`: the world size,
    epochs and max_steps it was made for): the checkpoint's figures, so a schedule
    sized from them is the uninterrupted run's. Another run (another world size, or
    the epochs or max_steps changed): the updates done + `left()`, the loader's
    upper estimate of the updates the rest of the run needs from its position at
    this world size (`updates_left`; the loader resumed first), so a schedule sized
    from it does not end before the run does. `warmup_base` is the run's first,
    kept by every resume (a fraction of progress)."""
    if saved is None:
        return RunFigures(plan.upper, plan.planned, plan.planned)
    warmup = saved.warmup_base or saved.planned or plan.planned
    if saved.same_run(world_size, epochs, max_steps):
        return RunFigures(saved.total or plan.upper, saved.planned or plan.planned, warmup)
    rest = left()
    if rest is None:  # unreachable: a loader with a plan has an estimate
        return RunFigures(plan.upper, plan.planned, warmup)
    done = saved.updates + rest
    return RunFigures(max(1, done), max(1, done), warmup, saved, rest)
