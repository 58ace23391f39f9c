"""`ProgressLR`: a `torch.optim.lr_scheduler.LRScheduler` on the run's exact progress.

    scheduler = ProgressLR(optimizer, loader, epochs=3, shape="cosine", warmup=0.05)
    for epoch in range(3):
        for batch in loader:
            ...
            if meta.sync_gradients:
                optimizer.step(); scheduler.step(); optimizer.zero_grad()

Its learning rate is `base_lr * Schedule.multiplier(p)`, p the run's progress
that the loader states (`loader.run_progress.fraction(epochs)`: samples of the
closed optimizer windows over epochs x the epoch's samples). So it is at the
schedule's start before the first update and at its final value right after the
last update, whatever the number of steps; after a resume (any world size) it
continues from the samples the resumed state has consumed. `step()` reads the
fact again rather than counting: extra or repeated calls (Accelerate's prepared
scheduler steps once per process) change nothing.

`source` is anything with a `run_progress` (a `RunProgress`): the loader for a
plain loop or Accelerate (`prepare_odb_loader`'s result too), the trainer
adapters' objects under HF and Lightning (the progress as of the batch that is
training, not of one prefetched).

Token-aware (`tokens=TokenScaling(reference, rule)`): each optimizer update's
rate is also multiplied by its window's global loss tokens over `reference`
(linear or square root), set by an optimizer step pre-hook right before the
update and taken back after it, so `get_last_lr()` stays the schedule's value
and `applied_lr` is what the last update used.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.hooks import RemovableHandle

from odb_core.errors import ConfigError
from odb_core.progress import RunProgress
from odb_core.schedule import Schedule, Shape, ShapeFn, TokenScaling

__all__ = ["ProgressLR", "ProgressSource"]

# What state_dict keeps: the scheduler's counters and rates, not its source.
_STATE_KEYS = ("base_lrs", "last_epoch", "_step_count", "_last_lr", "applied_lr")


class ProgressSource(Protocol):
    @property
    def run_progress(self) -> RunProgress: ...


class ProgressLR(LRScheduler):
    """Learning rate = base rate x `Schedule(shape, warmup, final).multiplier(p)`
    (x the token factor of the update's window, with `tokens=`), p the run's
    progress over `epochs` epochs as `source.run_progress` states it."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        source: ProgressSource,
        *,
        epochs: int,
        shape: Shape | str | ShapeFn = Shape.LINEAR,
        warmup: float = 0.0,
        final: float = 0.0,
        tokens: TokenScaling | None = None,
        last_epoch: int = -1,
    ) -> None:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"epochs={epochs!r} must be a positive integer")
        if not hasattr(type(source), "run_progress") and not hasattr(source, "run_progress"):
            raise ConfigError(
                f"source={type(source).__name__} states no run_progress: pass the "
                "ODBDataLoader (or prepare_odb_loader's result, ODBDataModule, ODBTrainer)"
            )
        if tokens is not None and not isinstance(tokens, TokenScaling):
            raise ConfigError(f"tokens={tokens!r} must be a TokenScaling or None")
        self.source = source
        self.epochs = epochs
        self.schedule = Schedule(shape, warmup, final)  # type: ignore[arg-type]
        self.tokens = tokens
        self.applied_lr: list[float] = []
        self._hooks: list[RemovableHandle] = []
        super().__init__(optimizer, last_epoch)
        if tokens is not None:
            self._hooks = [
                optimizer.register_step_pre_hook(self._scale_update),
                optimizer.register_step_post_hook(self._unscale_update),
            ]

    def progress(self) -> float:
        """The run's progress in [0, 1] as the source states it now."""
        return self.source.run_progress.fraction(self.epochs)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        m = self.schedule.multiplier(self.progress())
        return [float(base) * m for base in self.base_lrs]

    # ---- token-aware rate, around each optimizer update ----

    def _scale_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        assert self.tokens is not None
        factor = self.tokens.factor(self.source.run_progress.window_loss_tokens)
        self.applied_lr = [float(lr) * factor for lr in self._last_lr]
        for group, lr in zip(self.optimizer.param_groups, self.applied_lr, strict=True):
            group["lr"] = lr

    def _unscale_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr

    def remove_hooks(self) -> None:
        """Detach the token-aware hooks from the optimizer."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ---- state: counters only (the source is the loader, restored on its own) ----

    def state_dict(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in _STATE_KEYS if k in self.__dict__}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        unknown = set(state_dict) - set(_STATE_KEYS)
        if unknown:
            raise ConfigError(
                f"ProgressLR state has unknown keys {sorted(unknown)} (saved by another scheduler?)"
            )
        self.__dict__.update(state_dict)
