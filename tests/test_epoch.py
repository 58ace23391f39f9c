"""The pure epoch tracker (odb_core.epoch): the per-step record, the state before a
given step (what a prefetching trainer saves), the run plan and the close."""

from __future__ import annotations

import pytest

from odb_core.batch import Batch
from odb_core.epoch import EpochTracker, Position
from odb_core.errors import ODBError
from odb_core.resume import EpochProgress
from odb_core.sample import Sample
from odb_core.step import StepInfo

IDENTITY = {"fingerprint": {"dataset": "d"}, "epoch": 3, "world_size": 2, "rank": 1}


def _info(step: int, ids: tuple[int, ...], *, window: int, sync: bool) -> StepInfo:
    batch = Batch(tuple(Sample(i, 4) for i in ids))
    n = len(ids)
    return StepInfo(step, 1, step, False, batch, n, 2 * n, 4 * n, 8 * n, 4 * n, 8 * n, window, sync)


# steps 0..3, two windows of two steps; global_samples = 2 x the ids of this rank
STEPS = [
    _info(0, (10, 11), window=0, sync=False),
    _info(1, (12,), window=0, sync=True),
    _info(2, (13, 14, 15), window=1, sync=False),
    _info(3, (16,), window=1, sync=True),
]


def _tracked(n: int = len(STEPS)) -> EpochTracker:
    t = EpochTracker()
    t.reset(carry=((7,), ()))
    t.plan(None, exact=False)
    for info in STEPS[:n]:
        t.record(info, last_of_epoch=False)
    return t


@pytest.mark.parametrize("step", [0, 1, 2, 3])
def test_state_after_a_step_is_the_state_recorded_right_after_it(step: int) -> None:
    """An off-by-one in the record (the position after a step stored as the one
    before it, or the wrong record picked) shows here: the state after `step`
    must equal the current state of a tracker that stopped there."""
    full, stopped = _tracked(), _tracked(step + 1)
    assert full.after(step, **IDENTITY) == stopped.current(**IDENTITY)


def test_state_after_a_step_undoes_exactly_the_later_steps() -> None:
    state = _tracked().after(1, **IDENTITY)
    assert (state.step, state.emitted, state.window, state.closed) == (2, 6, 1, False)
    assert state.done == frozenset({10, 11, 12})
    assert state.carry == ((7,), ())
    assert state.rank == 1 and state.epoch == 3


def test_state_after_none_is_before_the_pass() -> None:
    state = _tracked().after(None, **IDENTITY)
    assert (state.step, state.emitted, state.window) == (0, 0, 0)
    assert state.done == frozenset()


def test_state_after_the_last_step_is_the_current_one() -> None:
    t = _tracked()
    current = t.current(**IDENTITY)
    assert t.after(3, **IDENTITY) == current
    assert (current.step, current.emitted, current.window) == (4, 14, 2)


def test_state_after_a_step_not_kept_or_not_yielded_is_refused() -> None:
    t = EpochTracker()
    t.plan(None, exact=False)
    for i in range(EpochTracker.HISTORY + 2):
        t.record(_info(i, (i,), window=i, sync=True), last_of_epoch=False)
    with pytest.raises(ODBError, match="only the last 4"):
        t.after(0, **IDENTITY)
    with pytest.raises(ODBError, match="more steps than are kept"):
        t.after(None, **IDENTITY)
    with pytest.raises(ODBError, match="step 5 is the last yielded"):
        t.after(9, **IDENTITY)


def test_a_resumed_pass_starts_at_the_loaded_position() -> None:
    loaded = EpochProgress(
        step=5,
        emitted=9,
        closed=False,
        base_done=frozenset({1}),
        done=frozenset({2, 3}),
        window=2,
        start_step=4,
        start_emitted=7,
        start_window=2,
        **IDENTITY,
    )
    t = EpochTracker()
    t.reset(loaded, carry=loaded.carry)
    assert t.position == Position(5, 9, False, 2, ())
    # exactly-once (not exact): the run starts where the epoch is
    run = t.plan(loaded, exact=False)
    assert run.start == (5, 9, 2) and run.skip_before == 0 and run.plan is loaded
    # exact: the saved run is replayed from its start, the done steps skipped
    run = t.plan(loaded, exact=True)
    assert run.start == (4, 7, 2) and run.skip_before == 5
    assert run.replay_ids == frozenset({2, 3})
    assert run.plan is not None and run.plan.done == frozenset()
    assert t.current(**IDENTITY).start_step == 4


def test_close_reports_whether_the_last_step_had_closed_it() -> None:
    t = _tracked(1)
    assert t.close(carry=((), (20,))) is True
    assert t.position.closed and t.position.carry == ((), (20,))
    again = _tracked(1)
    again.record(_info(1, (12,), window=0, sync=True), last_of_epoch=True)
    assert again.position.closed
    assert again.close() is False
    assert again.run_progress(epoch=0, epoch_samples=6).closed
