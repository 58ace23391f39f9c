"""Edges of the resume package (`odb_core.resume`) that the broader resume tests
pass over: the cross-rank claim check of a two-rank world, a state whose foreign
done ids make the count come out even, and the report of what was resumed (the
surviving mutants of `make mutants` on odb_core/resume/, docs/VERIFICATION.md)."""

from __future__ import annotations

from typing import Any

import pytest

from odb_core.errors import DuplicateIdError, ResumeStateError
from odb_core.resume import EpochProgress, ResumeClaim, ResumeReport, ResumeTarget, check_claims
from odb_core.resume.fit import check_fit
from odb_core.resume.record import partition

FP = {"seed": 5, "length": 60}


def _state(world: int, rank: int, done: set[int], emitted: int, **kw: Any) -> EpochProgress:
    fields: dict[str, Any] = {
        "fingerprint": FP,
        "epoch": 0,
        "step": 2,
        "emitted": emitted,
        "closed": False,
        "base_done": frozenset(),
        **kw,
    }
    return EpochProgress(world_size=world, rank=rank, done=frozenset(done), **fields)


def test_two_ranks_may_not_both_claim_an_id_done() -> None:
    # Rank 0 did {0, 2}, rank 1 {1, 2}: 4 done ids for emitted=4 adds up, but id 2
    # is done on both ranks.
    parts = [_state(2, 0, {0, 2}, 4), _state(2, 1, {1, 2}, 4)]
    with pytest.raises(DuplicateIdError, match=r"^sample id 2 was done \(in the loaded state"):
        check_claims([ResumeClaim.of(p).to_vector() for p in parts], 1)
    fine = [_state(2, 0, {0, 2}, 4), _state(2, 1, {1, 3}, 4)]
    assert check_claims([ResumeClaim.of(p).to_vector() for p in fine], 1)


def test_a_state_claiming_another_ranks_ids_is_refused_when_the_counts_come_out_even() -> None:
    # Rank 0 of 2 owns ids 0 and 2 of the order 0..3; its state claims one of them
    # and both of rank 1's. Two of its own ids with one done leave one remaining:
    # 2 + 1 = 3 done ids, so a check that adds where it should subtract passes it.
    order = list(range(4))
    mine, theirs = partition(order, 2, 0), partition(order, 2, 1)
    state = _state(2, 0, {mine[0], *theirs}, 3)
    with pytest.raises(ResumeStateError, match=r"done id 1 is not one of this rank's samples"):
        check_fit(state, ResumeTarget(2, 0, join=False, order=order))
    assert check_fit(_state(2, 0, {mine[0]}, 1), ResumeTarget(2, 0, order=order)) == mine[1:]


def test_the_resume_report_carries_the_state_and_the_world_it_resumes_at() -> None:
    state = _state(2, 1, {3, 5}, 10, epoch=4, step=6, closed=False)
    report = ResumeReport.of(state, 8)
    assert report == ResumeReport(
        epoch=4, step=6, samples_done=10, closed=False, saved_world_size=2, world_size=8
    )
    assert report.to_dict() == {
        "epoch": 4,
        "step": 6,
        "samples_done": 10,
        "closed": False,
        "saved_world_size": 2,
        "world_size": 8,
    }
    closed = ResumeReport.of(_state(1, 0, {0, 1}, 2, closed=True), 1)
    assert (closed.closed, closed.saved_world_size, closed.world_size) == (True, 1, 1)
