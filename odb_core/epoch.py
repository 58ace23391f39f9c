"""Where one rank is in an epoch, step by step: the plan of a protocol run over it,
a record of the last few steps yielded, and the resumable state as of any of them.

The loader drives an `EpochTracker` (`reset` when a pass starts or a state is
loaded, `plan` when a protocol run starts, `record` for each step yielded,
`close` at the epoch's end) and reads `state` from it. A trainer that prefetches
(Lightning: one batch) saves `after(step in training)`, the state before the
step after it: the steps yielded since are undone (their ids not done, the
position before them), so a resume trains them again, each exactly once.

Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from odb_core.errors import ODBError
from odb_core.ledger import Ledgers
from odb_core.progress import RunProgress, WindowCounts
from odb_core.resume import EpochProgress
from odb_core.step import StepInfo

__all__ = ["EpochStart", "EpochTracker", "Position", "StepRecord"]


@dataclass(frozen=True)
class Position:
    """The epoch's position between two steps."""

    step: int  # the next step to yield
    emitted: int  # samples emitted this epoch, all ranks
    closed: bool  # the epoch has ended
    window: int  # the window a fresh protocol run opens next
    carry: Ledgers  # the pending carry (quota mode)


@dataclass(frozen=True)
class StepRecord:
    """A yielded step: its number, its sample ids and the position before it."""

    step: int
    ids: tuple[int, ...]
    before: Position


@dataclass(frozen=True)
class EpochStart:
    """Where a protocol run over the epoch starts: from `start` = (step, emitted,
    window) with `plan` (None: a fresh epoch), skipping the steps before
    `skip_before` whose ids are `replay_ids` (an exact resume replays its run)."""

    plan: EpochProgress | None
    start: tuple[int, int, int]
    skip_before: int = 0
    replay_ids: frozenset[int] = frozenset()


class EpochTracker:
    """One rank's position in the current epoch (see the module docstring)."""

    #: Steps kept for `state(step)` (a prefetching trainer reads at most a few behind).
    HISTORY = 4

    def __init__(self) -> None:
        self.progress = WindowCounts()
        self.reset()

    def reset(self, loaded: EpochProgress | None = None, carry: Ledgers = ()) -> None:
        """A pass starts at the epoch's start, or where `loaded` (a resumed state) was."""
        if loaded is None:
            self.position = Position(0, 0, False, 0, carry)
            self.base_done: frozenset[int] = frozenset()
            self.done: set[int] = set()
            self.start = (0, 0, 0)
        else:
            self.position = Position(
                loaded.step, loaded.emitted, loaded.closed, loaded.window, carry
            )
            self.base_done = loaded.base_done
            self.done = set(loaded.done)
            self.start = (loaded.start_step, loaded.start_emitted, loaded.start_window)
        pos = self.position
        self.progress.reset(samples=pos.emitted, updates=pos.window, closed=pos.closed)
        self.records: deque[StepRecord] = deque(maxlen=self.HISTORY)
        self.yielded = 0  # steps yielded by this pass

    def plan(self, loaded: EpochProgress | None, *, exact: bool) -> EpochStart:
        """The run that starts now: an exact resume replays the saved run from its
        start (skipping, not re-collating, the steps before the saved one); any other
        starts where the epoch is (a non-exact resume: at the loaded step)."""
        if loaded is not None and exact:
            run = EpochStart(
                replace(loaded, done=frozenset()),
                (loaded.start_step, loaded.start_emitted, loaded.start_window),
                loaded.step,
                loaded.done,
            )
        else:
            pos = self.position
            run = EpochStart(loaded, (pos.step, pos.emitted, pos.window))
        self.start = run.start
        return run

    def record(self, info: StepInfo, *, last_of_epoch: bool) -> None:
        """Step `info` was yielded (its window fields final)."""
        before = self.position
        self.yielded += 1
        self.records.append(StepRecord(info.step, tuple(info.sample_ids), before))
        self.done.update(info.sample_ids)
        self.position = Position(
            info.step + 1,
            before.emitted + info.global_samples,
            before.closed or last_of_epoch,
            info.window + 1,  # a fresh protocol run (a non-exact resume) opens the next
            before.carry,
        )
        self.progress.record(info, last_of_epoch=last_of_epoch)

    def close(self, carry: Ledgers | None = None) -> bool:
        """The epoch ended (with `carry` pending into the next pass); True when it
        had not already closed at its last step."""
        pos = self.position
        self.position = replace(pos, closed=True, carry=pos.carry if carry is None else carry)
        return not pos.closed

    def set_carry(self, carry: Ledgers) -> None:
        self.position = replace(self.position, carry=carry)

    def run_progress(self, epoch: int, epoch_samples: int) -> RunProgress:
        """The run's progress as of the last step yielded (or the pass's start)."""
        return self.progress.progress(epoch, epoch_samples, closed=self.position.closed)

    def current(self, **identity: Any) -> EpochProgress:
        """The resumable state as of the last step yielded (or the pass's start).
        `identity` is `EpochProgress`' fingerprint, epoch, world_size and rank."""
        return self._progress_of(self.position, frozenset(self.done), identity)

    def after(self, step: int | None, **identity: Any) -> EpochProgress:
        """The resumable state before step `step + 1` (None: before the pass's first
        step), `step` one of the last `HISTORY` yielded: the steps yielded after it
        are undone, so a resume continues with step `step + 1`."""
        records = list(self.records)
        if step is None and records:
            if self.yielded > len(records):
                raise ODBError("state after None: the pass has yielded more steps than are kept")
            step = records[0].step - 1
        if step is None or not records or step >= records[-1].step:
            if step is not None and records and step > records[-1].step:
                raise ODBError(f"state after {step}: step {records[-1].step} is the last yielded")
            return self.current(**identity)
        later = [r for r in records if r.step > step]
        if len(later) == len(records) and records[0].step != step + 1:
            raise ODBError(
                f"state after {step}: only the last {len(records)} yielded steps are kept "
                f"(from {records[0].step})"
            )
        undone = {i for r in later for i in r.ids}
        return self._progress_of(later[0].before, frozenset(self.done - undone), identity)

    def _progress_of(
        self, pos: Position, done: frozenset[int], identity: Mapping[str, Any]
    ) -> EpochProgress:
        start_step, start_emitted, start_window = self.start
        return EpochProgress(
            step=pos.step,
            emitted=pos.emitted,
            closed=pos.closed,
            base_done=self.base_done,
            done=done,
            carry=pos.carry,
            window=pos.window,
            start_step=start_step,
            start_emitted=start_emitted,
            start_window=start_window,
            **identity,
        )
