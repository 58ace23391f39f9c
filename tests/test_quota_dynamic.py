"""Quota mode with dynamic sharding through the real loader (in-process ranks).

The core and the spec close a dynamic quota pass like a static one, carrying the
undealt rest of the plan with the unread ids (proofs/dynamic_sharding.md D1,
`MCdynamic_quota_w2_n6_k2`). The loader's part: each rank's ledger is what its
close carried, the ids it was dealt and never read, and (rank 0's) the plan ids
no rank was dealt; the next pass's plan starts with the ledger. Checked here:
the pass closes at the step the global count reaches the quota, every id of the
pass is emitted once or in the (identical) ledger, the next pass deals the ledger
first (`assert_dealt_first`), across a merged resume at the same and another
world size, and the run's traces pass both checkers. (That the next pass also emits every
carried id is proved for static sharding only, proofs/cross_epoch_fairness.md:
not asserted here.) Real gloo ranks: tests/test_quota_dynamic_gloo.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_quota_resume import (  # noqa: E402
    QUOTA,
    N,
    Text,
    check_ledger,
    check_quota_cut,
    fresh,
    global_counts,
)
from test_tlc import require_tlc  # noqa: E402
from thread_ranks import on_ranks, to_the_end, until  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.assign import initial_cursor  # noqa: E402
from odb_core.errors import ConfigError  # noqa: E402
from odb_core.step import StepInfo  # noqa: E402
from odb_core.verify.tlc.trace_check import validate_trace_tlc  # noqa: E402
from odb_core.verify.trace_validation import ProtocolTrace, validate_trace  # noqa: E402

pytestmark = pytest.mark.torch

DYN: dict[str, Any] = {"sharding": "dynamic", "buffer_size": 3}


def assert_dealt_first(plan: tuple[int, ...], carried: tuple[int, ...], world: int) -> None:
    """The plan deals `carried` first: it heads the plan, but for the initial shares,
    which a learned table places (`CostTable.placed`: the ids dealt up front are the
    same, reordered, and a rank's share keeps their plan order), so the carried ids
    are all among the first max(initial cursor, len(carried)) and, on one rank,
    exactly the first."""
    n = len(plan)
    cursor = initial_cursor(n, world, DYN["buffer_size"], priced=True)
    assert set(carried) <= set(plan[: max(cursor, len(carried))])
    if world == 1:
        assert plan[: len(carried)] == carried


def two_passes(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
    infos, _ = to_the_end(loader)
    first = (list(loader.ledger), [i for info in infos for i in info.sample_ids])
    loader.__dict__["_test_first"] = first
    return until(-1, epoch=1)(loader)


@pytest.mark.parametrize("world", [1, 2])
def test_a_pass_closes_at_the_quota_and_carries_every_id_it_did_not_emit(world: int) -> None:
    results = on_ranks(world, fresh(**DYN), two_passes)
    ledger, _ = results[0].loader.__dict__["_test_first"]
    emitted = [i for r in results for i in r.loader.__dict__["_test_first"][1]]
    assert all(r.loader.__dict__["_test_first"][0] == ledger for r in results), "one ledger"
    assert ledger and sorted(emitted + ledger) == list(range(N)), "each id once, or carried"
    assert sum(1 for _ in emitted) >= QUOTA
    # The next pass deals the ledger first (and forms it first).
    for r in results:
        assert r.loader.carried_in == tuple(ledger)
        assert_dealt_first(r.loader._plan, tuple(ledger), world)
    check_ledger([results])


@pytest.mark.parametrize(("w1", "w2"), [(2, 1), (1, 2), (2, 2)])
def test_a_merged_resume_keeps_the_ledger_and_the_quota_exact(w1: int, w2: int) -> None:
    before = on_ranks(w1, fresh(**DYN), until(2))
    states = [r.state for r in before]
    after = on_ranks(w2, fresh(states, **DYN), to_the_end)
    assert after[0].infos[0].step == 2
    check_quota_cut(global_counts(before[0].infos), global_counts(after[0].infos))
    check_ledger([before, after])


@pytest.mark.parametrize(("w1", "w2"), [(2, 2), (2, 1)])
def test_a_merged_resume_inside_a_carried_pass(w1: int, w2: int) -> None:
    def first_then_part(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
        to_the_end(loader)
        assert loader.ledger
        return until(2, epoch=1)(loader)

    before = on_ranks(w1, fresh(**DYN), first_then_part)
    carried = before[0].loader.carried_in
    assert carried
    after = on_ranks(w2, fresh([r.state for r in before], **DYN), to_the_end)
    done = {i for r in before for i in r.ids}
    left = tuple(i for i in carried if i not in done)
    for r in after:  # what is left of the carry is dealt first, also after the resume
        assert_dealt_first(r.loader._plan, left, w2)
    check_quota_cut(global_counts(before[0].infos), global_counts(after[0].infos))
    check_ledger([before, after])


def test_the_ledger_is_wrong_without_the_undealt_plan() -> None:
    """The check above can fail: a close that forgets the plan ids no rank was
    dealt (rank 0's part of the ledger) loses them."""
    from odb_core.torch.pipeline import EpochPipeline

    ledger = EpochPipeline._ledger

    def forgetting(self: EpochPipeline, carried: Any) -> tuple[int, ...]:
        undealt = set(self.s.machine.unassigned)
        return tuple(i for i in ledger(self, carried) if i not in undealt)

    mp = pytest.MonkeyPatch()
    mp.setattr(EpochPipeline, "_ledger", forgetting)
    try:
        results = on_ranks(2, fresh(**DYN), to_the_end)
    finally:
        mp.undo()
    with pytest.raises(AssertionError):
        check_ledger([results])


@pytest.mark.tlc
def test_traces_of_a_carried_dynamic_pass_pass_both_checkers(tmp_path: Path) -> None:
    require_tlc()

    def passes(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
        to_the_end(loader)
        return until(-1, epoch=1)(loader)

    on_ranks(2, fresh(trace_dir=tmp_path, **DYN), passes)
    for epoch in (0, 1):
        trace = ProtocolTrace.merge(sorted(tmp_path.glob(f"trace-epoch{epoch}-*.json")))
        assert trace.protocol["mode"] == "quota" and trace.protocol["sharding"] == "dynamic"
        assert bool(trace.protocol.get("carried")) == (epoch == 1)
        for which, check in (("python", validate_trace), ("tlc", validate_trace_tlc)):
            report = check(trace)
            assert report.ok, f"epoch {epoch}, {which}: {report.reason}"


def test_dynamic_sharding_refuses_what_it_cannot_deal_naming_it() -> None:
    with pytest.raises(ConfigError, match="partition=False"):
        ODBDataLoader(
            Text(N), token_budget=64, sharding="dynamic", partition=False, sampler=range(N)
        )
