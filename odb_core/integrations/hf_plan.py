"""The HF Trainer's view of the run's plan (docs/TRAINERS.md, "Hugging Face Trainer",
"The run's plan on resume"): the loop's sizes `ODBHFTrainer.set_initial_training_values`
returns (a per-epoch step cap no epoch reaches, the epoch count, the estimated
optimizer steps a step-sized schedule is sized to), the run's figures on a resume
(`odb_core.torch.plan.resumed_figures`, the one resume rule), and the warning when a
resume resized a step-sized schedule. No transformers import: the arguments are a
`TrainingArguments`, read only."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from odb_core.integrations.short_schedule import resized_schedule_message
from odb_core.integrations.versions import warn_once
from odb_core.torch import ODBDataLoader
from odb_core.torch.plan import RunFigures, RunPlan, resumed_figures, updates_left, updates_plan

__all__ = ["LoopSizes", "loop_sizes", "warn_resized"]

log = logging.getLogger("odb_core")


@dataclass(frozen=True)
class LoopSizes:
    """What `loop_sizes` plans: `sizes`, the Trainer's 7-tuple (epochs, the per-epoch
    cap, samples per epoch, samples of the run, samples per update, batches per
    epoch, max_steps); `schedule_steps`, the length of a step-sized schedule (upper);
    `planned`, the planned updates (`state.max_steps`, central); `figures`, those of
    the run's plan when it is a number of epochs (None otherwise)."""

    sizes: tuple[int, int, int, int, int, int, int]
    schedule_steps: int
    planned: int
    figures: RunFigures | None = None


def loop_sizes(
    args: Any, loader: ODBDataLoader, epochs: int | None, saved: RunPlan | None
) -> LoopSizes:
    """The loop's sizes of a run of `epochs` loader epochs (None: `args.max_steps`
    updates) over `loader`, resumed from a checkpoint's plan `saved` (None: fresh)."""
    accum, max_steps = args.gradient_accumulation_steps, args.max_steps
    plan = updates_plan(loader, epochs or 1)
    if plan is None:  # a stream, run for max_steps (the Trainer rejects it otherwise)
        per_update = args.world_size
        examples = max_steps * per_update
        sizes = (
            sys.maxsize,
            max_steps,
            examples,
            examples,
            per_update,
            max_steps * accum,
            max_steps,
        )
        return LoopSizes(sizes, max_steps, max_steps)
    per_epoch, samples = plan.epoch_cap, plan.samples
    schedule_steps = planned = max_steps
    figures = None
    if epochs is not None:
        max_steps = epochs * per_epoch
        figures = resumed_figures(  # the one resume rule (odb_core.torch.plan)
            plan,
            saved,
            world_size=loader.world_size,
            epochs=epochs,
            max_steps=args.max_steps,
            left=lambda: updates_left(loader, epochs),
        )
        schedule_steps, planned = figures.total, figures.planned
    log.info(plan.describe(schedule_steps))
    per_update = plan.samples_per_update
    train_samples = samples * epochs if epochs is not None else max_steps * per_update
    run_epochs = epochs or sys.maxsize
    sizes = (
        run_epochs,
        per_epoch,
        samples,
        train_samples,
        per_update,
        per_epoch * accum,
        max_steps,
    )
    return LoopSizes(sizes, schedule_steps, planned, figures)


def warn_resized(
    warned: set[str],
    figures: RunFigures | None,
    *,
    scheduler_type: Any,
    world_size: int,
    epochs: int | None,
) -> None:
    """A step-sized schedule of a run a resume replanned changes length there: warn
    once (`warned` key "replanned")."""
    saved = None if figures is None else figures.replanned
    if figures is None or saved is None or saved.total == figures.total:
        return
    message = resized_schedule_message(
        figures,
        f"the length of lr_scheduler_type={scheduler_type!r}",
        world_size=world_size,
        epochs=epochs,
        fix="An lr_scheduler_type run on progress (linear, cosine, constant, "
        "constant_with_warmup, cosine_with_min_lr; no other lr_scheduler_kwargs)",
    )
    warn_once(warned, "replanned", message)
