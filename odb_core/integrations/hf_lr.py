"""HF Trainer's learning-rate arguments as a progress-driven `Schedule`, and `ClampedLR`
for the types without one.

`TrainingArguments(lr_scheduler_type=..., warmup_steps=..., lr_scheduler_kwargs=...)`
names a schedule of the optimizer step; `ODBHFTrainer` runs the same shape on the
run's exact progress (`odb_core.torch.ProgressLR`), so it ends on the last update.
The types with a progress form: linear, cosine (the default half cycle),
constant, constant_with_warmup, cosine_with_min_lr. Any other type (or
arguments this mapping does not know) returns None: the Trainer's own schedule,
sized from the step estimate.

`warmup_steps` below 1 is a fraction of the run, as in transformers; from 1 up it
counts optimizer updates, converted to a fraction of the run's planned updates
(so warmup lasts about that many updates; the end of the run stays exact).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from odb_core.errors import ConfigError
from odb_core.schedule import Schedule, Shape

__all__ = ["ClampedLR", "progress_lr", "progress_schedule"]

_SHAPES = {
    "linear": Shape.LINEAR,
    "cosine": Shape.COSINE,
    "constant": Shape.CONSTANT,
    "constant_with_warmup": Shape.CONSTANT,
    "cosine_with_min_lr": Shape.COSINE,
}


def progress_schedule(
    lr_scheduler_type: Any,
    *,
    warmup_steps: float,
    scheduler_kwargs: object,
    learning_rate: float,
    planned_updates: int,
) -> Schedule | None:
    """The `Schedule` that runs HF's schedule on progress, or None where there is none."""
    name = str(getattr(lr_scheduler_type, "value", lr_scheduler_type))
    shape = _SHAPES.get(name)
    if shape is None:
        return None
    if scheduler_kwargs is not None and not isinstance(scheduler_kwargs, Mapping):
        return None  # e.g. an unparsed JSON string: the Trainer's own handling
    kwargs = dict(scheduler_kwargs or {})
    final = 0.0
    if name.startswith("cosine") and kwargs.pop("num_cycles", 0.5) != 0.5:
        return None  # several cycles: the Trainer's own schedule
    if name == "cosine_with_min_lr":
        rate, floor = kwargs.pop("min_lr_rate", None), kwargs.pop("min_lr", None)
        if (rate is None) == (floor is None):
            raise ConfigError(
                "lr_scheduler_type='cosine_with_min_lr' needs exactly one of min_lr and "
                f"min_lr_rate in lr_scheduler_kwargs; got min_lr={floor!r}, min_lr_rate={rate!r}"
            )
        final = float(rate) if rate is not None else float(floor) / float(learning_rate)
    if kwargs:
        return None  # arguments only the Trainer's own schedule knows
    warmup = 0.0 if name == "constant" else _warmup_fraction(warmup_steps, planned_updates)
    return Schedule(shape, warmup=warmup, final=final)


def progress_lr(
    args: Any, optimizer: Any, source: Any, *, epochs: int, planned_updates: int, tokens: Any
) -> Any:
    """A `ProgressLR` over `epochs` epochs of `source` running the schedule that
    `args` (`TrainingArguments`) names, token-aware with `tokens`; None where the
    type has no progress form (`tokens` then raises: the token-aware rate needs one)."""
    from odb_core.torch.lr_scheduler import ProgressLR

    schedule = progress_schedule(
        args.lr_scheduler_type,
        warmup_steps=args.warmup_steps,
        scheduler_kwargs=args.lr_scheduler_kwargs,
        learning_rate=args.learning_rate,
        planned_updates=planned_updates,
    )
    if schedule is None:
        if tokens is not None:
            raise ConfigError(
                f"odb lr_tokens needs a progress-driven schedule; lr_scheduler_type="
                f"{args.lr_scheduler_type!r} with lr_scheduler_kwargs="
                f"{args.lr_scheduler_kwargs!r} has none (use linear, cosine, constant, "
                "constant_with_warmup or cosine_with_min_lr)"
            )
        return None
    shape, warmup, final = schedule.shape, schedule.warmup, schedule.final
    return ProgressLR(
        optimizer, source, epochs=epochs, shape=shape, warmup=warmup, final=final, tokens=tokens
    )


def _warmup_fraction(warmup_steps: float, planned_updates: int) -> float:
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, float)):
        raise ConfigError(f"warmup_steps={warmup_steps!r} must be a number")
    if not math.isfinite(warmup_steps) or warmup_steps < 0:
        raise ConfigError(f"warmup_steps={warmup_steps!r} must be >= 0")
    if warmup_steps < 1:
        return float(warmup_steps)
    if warmup_steps >= planned_updates:
        raise ConfigError(
            f"warmup_steps={warmup_steps!r} is not below the run's planned "
            f"{planned_updates} optimizer updates: the learning rate would never decay; "
            "give fewer steps or a fraction in [0, 1)"
        )
    return float(warmup_steps) / planned_updates


class ClampedLR:
    """An LR scheduler that stops advancing after `total` steps: sized from an
    estimate, it never steps past its end (a cosine would come back up)."""

    def __init__(self, scheduler: Any, total: int) -> None:
        self.scheduler = scheduler
        self.total = int(total)

    @classmethod
    def around(cls, scheduler: Any, total: int) -> Any:
        """`scheduler` clamped at `total` steps; as it is when it has no step count
        (`last_epoch`), is `ReduceLROnPlateau` (driven by a metric) or is clamped."""
        from torch.optim.lr_scheduler import ReduceLROnPlateau

        if not hasattr(scheduler, "last_epoch") or isinstance(scheduler, (cls, ReduceLROnPlateau)):
            return scheduler
        return cls(scheduler, total)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.scheduler.last_epoch < self.total:
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return list(self.scheduler.get_last_lr())

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)
