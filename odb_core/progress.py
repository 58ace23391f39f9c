"""How much of a training run is done: the clock of learning-rate schedules.

Every rank knows, exactly and identically, the global samples and loss tokens of
every step (the round's all-gather carries them) and where each optimizer window
closes. So the samples consumed by the closed windows of an epoch, out of the
samples an epoch consumes, is a protocol fact, not an estimate; over `epochs`
epochs it is the run's progress in [0, 1], which ends at exactly 1 with the
last update whatever the number of steps, also after a resume at another world
size (the resumed state's emitted count gives the samples consumed).

`WindowCounts` folds the steps a loader yields into that fact;
`RunProgress` is the fact at one position.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from odb_core.errors import ConfigError, ODBError
from odb_core.step import StepInfo


@dataclass(frozen=True)
class RunProgress:
    """The run's progress as of one position (a step yielded, or the start of a
    pass). Counts are global (all ranks) and of the current `epoch`:

    - `samples`, `loss_tokens`, `updates`: consumed by the epoch's *closed*
      optimizer windows (a window is closed once its last step, the one with
      `sync_gradients`, is reached), so a step inside a window does not move
      them; `loss_tokens` counts from the start of this process's run of the
      epoch (a resumed state records samples, not loss tokens).
    - `epoch_samples`: what one epoch consumes (the dataset's, or the sampler's,
      length in join mode; the quota in quota mode); 0 when unknown (an
      IterableDataset, or `partition=False`).
    - `closed`: the epoch has ended (in quota mode possibly before its quota).
    - `window_samples`, `window_loss_tokens`: the totals of the optimizer window
      of the position's step (0 before the first step); known before the
      window's first backward, so an update's learning rate can use them.
    """

    epoch: int
    epoch_samples: int
    samples: int = 0
    loss_tokens: int = 0
    updates: int = 0
    closed: bool = False
    window_samples: int = 0
    window_loss_tokens: int = 0

    def fraction(self, epochs: int) -> float:
        """Progress of a run of `epochs` epochs, in [0, 1]: 1 exactly after the
        last window of the last epoch."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"epochs={epochs!r} must be a positive integer")
        if self.epoch_samples <= 0:
            raise ConfigError(
                "the run's progress needs the samples an epoch consumes, which this loader "
                "does not know (an IterableDataset, or partition=False): size the schedule "
                "in optimizer steps instead"
            )
        if self.epoch >= epochs:
            return 1.0
        done = self.epoch_samples if self.closed else min(self.samples, self.epoch_samples)
        return (self.epoch * self.epoch_samples + done) / (epochs * self.epoch_samples)

    @property
    def epochs_done(self) -> int:
        """Whole epochs done: `epoch`, plus one once it has closed (so a run of E
        epochs is over when this reaches E)."""
        return self.epoch + int(self.closed)

    @property
    def epochs_run(self) -> float:
        """The epochs run as a number, for a trainer's fractional epoch counter:
        `epochs_done` plus the open epoch's share of its samples consumed, held
        below 1 until the epoch closes (0 when the epoch's size is unknown)."""
        if self.closed or self.epoch_samples <= 0:
            return float(self.epochs_done)
        return self.epoch + min(self.samples / self.epoch_samples, 0.999)


@dataclass(frozen=True)
class _Counts:
    samples: int
    loss_tokens: int
    updates: int
    closed: bool
    window_samples: int
    window_loss_tokens: int


class WindowCounts:
    """The closed-window counts of one pass over an epoch, as steps are yielded,
    with the last few positions kept so a trainer that prefetches (Lightning: one
    batch) can read the progress as of the step it trains (`after(step)`)."""

    HISTORY = 4

    def __init__(self) -> None:
        self.reset()

    def reset(self, *, samples: int = 0, updates: int = 0, closed: bool = False) -> None:
        """A pass starts: `samples` already consumed this epoch and `updates` windows
        closed (a resumed state's emitted count and next window; 0 otherwise)."""
        self._start = _Counts(samples, 0, updates, closed, 0, 0)
        self._current = self._start
        self._open_samples = 0
        self._open_loss = 0
        self._history: deque[tuple[int, _Counts]] = deque(maxlen=self.HISTORY)

    def record(self, info: StepInfo, *, last_of_epoch: bool) -> None:
        """A step was yielded (its window fields are final)."""
        self._open_samples += info.global_samples
        self._open_loss += info.global_loss_tokens
        cur = self._current
        if info.sync_gradients or last_of_epoch:
            cur = _Counts(
                cur.samples + self._open_samples,
                cur.loss_tokens + self._open_loss,
                info.window + 1,
                last_of_epoch,
                info.window_samples,
                info.window_loss_tokens,
            )
            self._open_samples = self._open_loss = 0
        else:
            cur = _Counts(
                cur.samples,
                cur.loss_tokens,
                cur.updates,
                False,
                info.window_samples,
                info.window_loss_tokens,
            )
        self._current = cur
        self._history.append((info.step, cur))

    def progress(self, epoch: int, epoch_samples: int, *, closed: bool) -> RunProgress:
        """The progress as of the last step recorded (or the pass's start)."""
        return _progress(self._current, epoch, epoch_samples, closed or self._current.closed)

    def after(self, step: int | None, epoch: int, epoch_samples: int) -> RunProgress:
        """The progress as of step `step` of this pass, one of the last `HISTORY`
        recorded (None: the pass's start, before any step)."""
        if step is None:
            return _progress(self._start, epoch, epoch_samples, self._start.closed)
        for s, pos in reversed(self._history):
            if s == step:
                return _progress(pos, epoch, epoch_samples, pos.closed)
        known = [s for s, _ in self._history]
        raise ODBError(
            f"no progress recorded for step {step} of this pass (the last steps yielded: "
            f"{known}); read run progress at most {self.HISTORY - 1} steps behind the loader"
        )


def _progress(pos: _Counts, epoch: int, epoch_samples: int, closed: bool) -> RunProgress:
    return RunProgress(
        epoch=epoch,
        epoch_samples=epoch_samples,
        samples=pos.samples,
        loss_tokens=pos.loss_tokens,
        updates=pos.updates,
        closed=closed,
        window_samples=pos.window_samples,
        window_loss_tokens=pos.window_loss_tokens,
    )
