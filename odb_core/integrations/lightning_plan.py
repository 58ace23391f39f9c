"""The Lightning adapter's figures of the run (docs/TRAINERS.md, "Lightning",
`estimated_stepping_batches` and its resume): `estimated_stepping_batches` from the
loader's upper estimate (Lightning's reads `len()`, which the ODB train loader does
not have), the run's total on a resume (`odb_core.torch.plan.resumed_figures`, the
one resume rule), what the checkpoint keeps of the plan (`run_plan`), and the
warnings when the run passes that figure or ends short of it. `dm` is always the
run's `ODBDataModule` (odb_core.integrations.lightning, which imports this module
and checks that first)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from odb_core.integrations.short_schedule import resized_schedule_message, warn_short_schedule
from odb_core.integrations.versions import warn_once
from odb_core.torch.plan import RunPlan, UpdatesPlan, resumed_figures, updates_left

__all__ = [
    "check_past_estimate",
    "check_short_schedule",
    "planned_stepping_batches",
    "run_plan",
    "warned",
]

#: The Lightning adapter's warn-once keys (`odb_core.integrations.lightning._warned`).
warned: set[str] = set()


def planned_stepping_batches(dm: Any, trainer: pl.Trainer) -> int | float:
    """`estimated_stepping_batches` for an `ODBDataModule`: max_epochs x an upper
    estimate of an epoch's optimizer steps (capped by max_steps), reported to `dm`.

    Resumed from a checkpoint: the figure the run reported (saved in the checkpoint)
    at the same world size and epochs, so a schedule sized from it is the
    uninterrupted run's; at another world size (or other max_epochs / max_steps) the
    updates done + the loader's upper estimate of the updates the rest of the run
    needs there (`odb_core.torch.plan.updates_left`), with a warning: a schedule
    sized from it changes length at the resume."""
    max_epochs, max_steps = trainer.max_epochs, trainer.max_steps
    if max_epochs is None or max_epochs == -1:
        return float("inf") if max_steps == -1 else max_steps
    plan = dm.updates_plan(max(int(max_epochs), 1))
    if plan is None:
        warn_once(
            warned,
            "no-estimate",
            "an ODB loader over an IterableDataset has no step estimate: "
            "estimated_stepping_batches is max_steps, as in Lightning",
        )
        return max_steps
    total: int | float = _run_total(dm, trainer, max(int(max_epochs), 1), plan)
    if max_steps != -1:
        total = min(total, max_steps)
    dm.reported_estimate = total
    return total


def _run_total(dm: Any, trainer: pl.Trainer, epochs: int, plan: UpdatesPlan) -> int:
    """The run's planned updates (`resumed_figures`, the one resume rule): the plan's
    upper figure for a fresh run; on a resume, the figure the checkpoint holds (the
    same run) or the updates done + the updates the rest of the run needs at this
    world size, warned about (a schedule sized from it changes length)."""

    def left() -> int | None:
        dm.load_pending()  # the loader's position: where the rest of the run starts
        return updates_left(dm.loader, epochs)

    world = dm.loader.world_size
    figures = resumed_figures(
        plan,
        dm.saved_plan,
        world_size=world,
        epochs=trainer.max_epochs,
        max_steps=trainer.max_steps,
        left=left,
    )
    saved, total = figures.replanned, figures.total
    if saved is not None and saved.total is not None and total != saved.total:
        fix = "ProgressLR(optimizer, trainer.datamodule, epochs=trainer.max_epochs)"
        message = resized_schedule_message(
            figures,
            "estimated_stepping_batches (what a LambdaLR of total steps is sized to)",
            world_size=world,
            epochs=trainer.max_epochs,
            fix=f"{fix} in configure_optimizers",
        )
        warn_once(warned, "replanned", message)
    return total


def run_plan(dm: Any, trainer: pl.Trainer | None) -> RunPlan:
    """What the DataModule's checkpoint keeps of the run's plan (its `PLAN_KEY`
    entry): the world size, epochs and max_steps it is for, the updates done, and
    the `estimated_stepping_batches` reported (`total`). `dm`'s loader is built."""
    total = dm.reported_estimate
    return RunPlan(
        world_size=dm.loader.world_size,
        epochs=None if trainer is None else trainer.max_epochs,
        max_steps=-1 if trainer is None else trainer.max_steps,
        updates=0 if trainer is None else int(trainer.global_step),
        total=total if isinstance(total, int) else None,
    )


def check_past_estimate(dm: Any, trainer: pl.Trainer) -> None:
    """After a batch: warn once when the run has passed the figure it reported."""
    reported = dm.reported_estimate
    if reported is not None and trainer.global_step > reported:
        warn_once(
            warned,
            "estimate",
            f"the run passed estimated_stepping_batches={reported} (the loader's upper "
            "estimate was exceeded): an LR schedule sized to it has ended",
        )


def check_short_schedule(dm: Any, trainer: pl.Trainer) -> None:
    """After a run that ended by its epochs: warn when it took fewer updates than the
    `estimated_stepping_batches` it reported and a step-sized scheduler is attached
    (the first point the run's total is known)."""
    reported, done = dm.reported_estimate, trainer.global_step
    ended_by_epochs = not trainer.interrupted and trainer.current_epoch >= (trainer.max_epochs or 0)
    if reported is None or done >= reported or not ended_by_epochs:
        return
    warn_short_schedule(
        warned,
        (c.scheduler for c in trainer.lr_scheduler_configs),
        ran=f"the run ended after {done} optimizer updates of the "
        f"estimated_stepping_batches={reported} (the loader's upper estimate)",
        fix="ProgressLR(optimizer, self.trainer.datamodule, "
        "epochs=self.trainer.max_epochs) in configure_optimizers",
    )
