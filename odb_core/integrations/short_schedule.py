"""The warning for a learning-rate schedule sized in optimizer steps from the loader's
estimate when the run falls short of it (issue 33): a `LambdaLR` over Lightning's
`estimated_stepping_batches`, or a `LinearLR(total_iters=len(train) * epochs)` under
Accelerate, otherwise stops above its final rate with no sign. An ODB epoch's steps
are decided online, so the estimate is an upper one; `ProgressLR` follows the run's
progress instead and ends on the last update."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from odb_core.torch import ProgressLR


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
