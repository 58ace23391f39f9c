"""Which epoch an `ODBDataLoader` is in and which its next iteration runs
(`EpochCursor`): `set_epoch(e)` selects one (naming a completed epoch raises
`EpochFinishedError` unless `repeat=True`), iterating again after a completed
epoch starts the next, and a loaded state not yet iterated is the one its epoch
resumes from. `forward_epoch` passes the epoch on to a dataset with `set_epoch`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from odb_core.errors import ConfigError, EpochFinishedError
from odb_core.resume import EpochProgress

__all__ = ["EpochCursor", "forward_epoch"]


class EpochCursor:
    """The loader's epoch, whether it completed, and the state it resumes from."""

    def __init__(self) -> None:
        self.epoch = 0
        self.advance = False
        """The current epoch completed (iterated to its end, or loaded closed) and no
        set_epoch since: the next iter() starts epoch + 1."""
        self.serial = 0
        """Bumped by set_epoch / load_state_dict: older iterators stop counting."""
        self.resume: EpochProgress | None = None
        """The loaded state, until an iteration takes it (None: none)."""

    def pending(self) -> EpochProgress | None:
        """The loaded state, when it is the current epoch's."""
        r = self.resume
        return r if r is not None and r.epoch == self.epoch else None

    def select(self, epoch: int, *, repeat: bool, reset: Callable[[], None]) -> None:
        """`set_epoch(epoch, repeat=repeat)` (see `ODBDataLoader.set_epoch`); `reset`
        restarts the tracked progress of the epoch."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch={epoch!r} must be a non-negative integer")
        if self.advance and epoch <= self.epoch:
            if not repeat:
                raise EpochFinishedError(epoch, self.epoch)
            if self.resume is not None and self.resume.closed:
                self.resume = None
            reset()
        self.serial += 1
        self.advance = False
        if self.resume is not None and self.resume.epoch != epoch:
            if not self.resume.closed:
                warnings.warn(
                    f"set_epoch({epoch}) discards the loaded state of epoch "
                    f"{self.resume.epoch} (stopped at step {self.resume.step})",
                    stacklevel=3,
                )
            self.resume = None
        if epoch != self.epoch:
            reset()
        self.epoch = epoch

    def next_epoch(self, reset: Callable[[], None]) -> int:
        """The epoch completed and set_epoch was not called since: start the next.
        Returns the completed one."""
        done = self.epoch
        self.advance = False
        self.resume = None
        self.epoch = done + 1
        reset()
        return done


def forward_epoch(dataset: Any, epoch: int, *, stale_workers: bool, stacklevel: int) -> None:
    """Forward `epoch` to the dataset's `set_epoch`, if it has one; `stale_workers`:
    persistent workers are running, whose copies do not see it (warned)."""
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        if stale_workers:
            warnings.warn(
                "persistent_workers=True: the dataset copies in the running workers do "
                "not see set_epoch (a DataLoader limitation); only the main process copy "
                "is updated",
                stacklevel=stacklevel,
            )
        set_epoch(epoch)
