"""The warning for a learning-rate schedule sized in optimizer steps from the loader's
estimate when the run falls short of it (issue 33): a `LambdaLR` over Lightning's
`estimated_stepping_batches`, or a `LinearLR(total_iters=len(train) * epochs)` under
Accelerate, otherwise stops above its final rate with no sign. An ODB epoch's steps
are decided online, so the estimate is an upper one; `ProgressLR` follows the run's
progress instead and ends on the last update. Also the warning for a schedule sized
from a figure a resume replanned (`resized_schedule_message`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from odb_core.integrations.versions import warn_once
from odb_core.torch import ProgressLR
from odb_core.torch.plan import RunFigures


def step_sized(schedulers: Iterable[Any]) -> list[Any]:
    """The schedulers that are not `ProgressLR` (Accelerate's wrappers unwrapped)."""
    inner = (getattr(s, "scheduler", s) for s in schedulers)
    return [s for s in inner if not isinstance(s, ProgressLR)]


def short_schedule_message(scheduler: Any, *, ran: str, fix: str) -> str:
    """What `ran` (the shortfall, in the adapter's words) leaves `scheduler` at, and
    the fix (`fix`: the `ProgressLR(...)` call for this trainer)."""
    lr, base = float(scheduler.get_last_lr()[0]), float(scheduler.base_lrs[0])
    of_base = f", {lr / base:.2g} of its base rate {base:.2g}" if base else ""
    return (
        f"{ran}: a schedule sized in steps from that estimate falls short of its end "
        f"({type(scheduler).__name__} stands at lr {lr:.2g}{of_base}). {fix} follows the "
        "run's progress and ends exactly on its last update"
    )


def warn_short_schedule(
    warned: set[str], schedulers: Iterable[Any], *, ran: str, fix: str, stacklevel: int = 4
) -> None:
    """Warn once (`warned` key "short") when a step-sized scheduler is among
    `schedulers`: `short_schedule_message` of the first; `stacklevel` as the
    caller's own `warnings.warn` would take it."""
    sized = step_sized(schedulers)
    if sized:
        message = short_schedule_message(sized[0], ran=ran, fix=fix)
        warn_once(warned, "short", message, stacklevel=stacklevel + 1)


def resized_schedule_message(
    figures: RunFigures, figure: str, *, world_size: int, epochs: int | None, fix: str
) -> str:
    """A resume replanned `figure` (`figures.replanned` set): what that makes of a
    schedule sized from it, and the fix (`fix`: the `ProgressLR(...)` call)."""
    return (
        figures.replanned_as(figure, world_size, epochs)
        + ". A schedule sized from it changes length at the resume: its rate jumps there, "
        f"and it ends near, not exactly on, the last update. {fix} follows the run's "
        "progress and ends exactly on the last update"
    )
