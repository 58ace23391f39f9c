"""Trace checks of dynamic-sharding runs: the deals replayed by both checkers.

A dynamic run's trace carries the epoch's plan, the held tail of every vector
and the ids each round's deal gave each rank. The Python
replay (`validate_trace`) deals with the core's own code; the TLC replay
(`validate_trace_tlc`) with the spec's `Deal`. Recorded runs (several
RankMachines in-process, and the torch loader on in-process ranks) pass both;
broken runs (a deal that gives one id to two ranks, a rank that finds its
source dry while the plan is not dealt out, a rank that observes an id it was
not dealt) fail both, for that reason and at that event, under the trace
module's invariant names (`TraceDealMatches`, `TraceExhaustsDealtOut`,
`TraceObservesDealt`). Dynamic sharding adds these fields within trace version 3;
static-sharding traces are unchanged."""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_tlc import BY_NAME, require_tlc
from test_trace_tlc import cli_accepts_per_rank_files

from odb_core.cli import main
from odb_core.config import ProtocolConfig
from odb_core.cost import Budget
from odb_core.protocol import RankAction
from odb_core.trace import TracingRankMachine
from odb_core.verify.conformance import record_random_trace
from odb_core.verify.model import ModelConfig, dynamic_model
from odb_core.verify.tlc.trace_check import validate_trace_tlc
from odb_core.verify.trace_validation import ProtocolTrace, TraceReport, validate_trace

COSTS = [(i * 7) % 11 + 1 for i in range(24)]


def core_config(mode: str = "join", world: int = 3) -> ModelConfig:
    """24 samples of costs 1..11, a shuffled plan: deals by cost, starved ranks,
    a rank dry while another holds work."""
    protocol = ProtocolConfig(
        world_size=world,
        budget=Budget(12),
        buffer_size=3,
        max_steps_per_round=2,
        mode=mode,  # type: ignore[arg-type]
        quota=9 if mode == "quota" else None,
        sharding="dynamic",  # type: ignore[arg-type]
    )
    cfg = dynamic_model(protocol, COSTS)
    plan = list(cfg.protocol.plan)
    random.Random(3).shuffle(plan)
    return replace(cfg, protocol=replace(cfg.protocol, plan=tuple(plan)))


def renamed(trace: ProtocolTrace, f: Callable[[int], int]) -> ProtocolTrace:
    """The trace with every sample id i written f(i), as a run over other ids."""
    out = copy.deepcopy(trace)
    out.protocol["plan"] = [f(i) for i in out.protocol["plan"]]
    for rt in out.ranks:
        for e in rt.events:
            if e["action"] == "Observe":
                e["sample"][0] = f(e["sample"][0])
            elif e["action"] == "Receive":
                e["steps"] = [None if s is None else [f(i) for i in s] for s in e["steps"]]
                e["dealt"] = [f(i) for i in e["dealt"]]
    return out


def both(trace: ProtocolTrace) -> dict[str, TraceReport]:
    return {"python": validate_trace(trace), "tlc": validate_trace_tlc(trace)}


# ---- recorded runs pass both checkers -----------------------------------------


def test_a_dynamic_trace_records_the_plan_the_held_tail_and_the_deals() -> None:
    cfg = core_config()
    trace = ProtocolTrace.from_json(json.loads(json.dumps(record_random_trace(cfg, 0).to_json())))
    assert trace.protocol["sharding"] == "dynamic"
    assert trace.protocol["plan"] == list(cfg.protocol.plan)
    assert all(rt.plan is None for rt in trace.ranks), "no rank has a plan of its own"
    m = cfg.protocol.max_steps_per_round
    for rt in trace.ranks:
        for e in rt.events:
            if e["action"] == "Contribute":
                assert len(e["vector"]) == 2 + 3 * m + 3
            if e["action"] == "Receive":
                assert isinstance(e["dealt"], list)
    # Every plan id is dealt once: the initial shares, then the recorded deals.
    dealt = [i for rt in trace.ranks for e in rt.events if e["action"] == "Receive"
             for i in e["dealt"]]  # fmt: skip
    assert len(dealt) == len(set(dealt)) and dealt, "the later deals give ids out"
    assert validate_trace(trace).ok


@pytest.mark.parametrize("mode", ["join", "quota"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recorded_core_runs_pass_the_python_replay(mode: str, seed: int) -> None:
    trace = record_random_trace(core_config(mode), seed)
    report = validate_trace(trace)
    assert report.ok, report.reason
    # Ids other than 0..N-1 (renumbered by the checker, the plan's order kept).
    report = validate_trace(renamed(trace, lambda i: 1000 + 7 * i))
    assert report.ok, report.reason


@pytest.mark.tlc
@pytest.mark.parametrize(
    "name", ["MCdynamic_w2_n7_k2", "MCdynamic_quota_w2_n6_k2", "MCdynamic_w2_n7_k2_det"]
)
def test_recorded_runs_of_the_manifest_models_pass_both(name: str) -> None:
    require_tlc()
    trace = record_random_trace(BY_NAME[name].model_config(), 4)
    reports = both(trace)
    for which, report in reports.items():
        assert report.ok, f"{which}: {report.reason}"
    assert sorted(reports["tlc"].actions) == sorted(reports["python"].actions)


@pytest.mark.tlc
@pytest.mark.parametrize("mode", ["join", "quota"])
def test_recorded_core_runs_pass_tlc(mode: str) -> None:
    require_tlc()
    trace = renamed(record_random_trace(core_config(mode), 1), lambda i: 1000 + 7 * i)
    if mode == "quota":  # the close carries plan ids no rank was dealt
        seen = {e["sample"][0] for rt in trace.ranks for e in rt.events if e["action"] == "Observe"}
        assert set(trace.protocol["plan"]) - seen
    for which, report in both(trace).items():
        assert report.ok, f"{which}: {report.reason}"


# ---- broken runs fail both, for their reason -----------------------------------


class OverlappingDeal(TracingRankMachine):
    """Broken: rank 1 also loads the plan id before its slice of a deal, so the
    deal gives that id to two ranks."""

    def _dealt_slice(self, assigned: tuple[int, ...]) -> tuple[int, int]:
        start, stop = super()._dealt_slice(assigned)
        if self.rank == 1 and assigned[1] > 0 and start > 0:
            start -= 1
        return start, stop


class DryWhenStarved(TracingRankMachine):
    """Broken: the last rank takes 'nothing left to read' for a dry source while the
    plan is not dealt out yet, and stops reading (the ids dealt to it later are lost)."""

    @property
    def starved(self) -> bool:
        return False if self.rank == self.config.world_size - 1 else super().starved

    def exhaust(self) -> None:
        self._require(RankAction.EXHAUST)
        self.exhausted = True
        self.trace.events.append({"action": "Exhaust"})


def _receives(trace: ProtocolTrace, r: int) -> list[tuple[int, dict[str, Any]]]:
    return [(k, e) for k, e in enumerate(trace.ranks[r].events) if e["action"] == "Receive"]


def overlapping_deal() -> tuple[ProtocolTrace, int, int]:
    trace = record_random_trace(core_config(), 0, machine=OverlappingDeal)
    k, receive = next((k, e) for k, e in _receives(trace, 1) if e["dealt"])
    others = {i for r in (0, 2) for _, e in _receives(trace, r) for i in e["dealt"]}
    start = [i for rt in trace.ranks for e in rt.events[:1] if e["action"] == "Observe"
             for i in e["sample"][:1]]  # fmt: skip
    twice = set(receive["dealt"]) & (others | set(start) | _initial(trace, 0))
    assert twice, "the broken deal gives an id to two ranks"
    return trace, 1, k


def _initial(trace: ProtocolTrace, r: int) -> set[int]:
    """Ids rank r observed before its first Receive: its initial share."""
    out = set()
    for e in trace.ranks[r].events:
        if e["action"] == "Receive":
            break
        if e["action"] == "Observe":
            out.add(e["sample"][0])
    return out


def dry_when_starved() -> tuple[ProtocolTrace, int, int]:
    trace = record_random_trace(core_config(), 0, machine=DryWhenStarved)
    r = len(trace.ranks) - 1
    k = next(k for k, e in enumerate(trace.ranks[r].events) if e["action"] == "Exhaust")
    rounds_before = sum(1 for e in trace.ranks[r].events[:k] if e["action"] == "Receive")
    later = [e["dealt"] for _, e in _receives(trace, 0)[rounds_before:]]
    assert any(later), "the rank found its source dry before the plan was dealt out"
    return trace, r, k


def observes_undealt() -> tuple[ProtocolTrace, int, int]:
    """Hand-tampered: rank 1's first observation is a sample rank 0 was dealt."""
    trace = record_random_trace(core_config(), 0)
    theirs = next(e["sample"] for e in trace.ranks[0].events if e["action"] == "Observe")
    k = next(k for k, e in enumerate(trace.ranks[1].events) if e["action"] == "Observe")
    trace.ranks[1].events[k]["sample"] = list(theirs)
    return trace, 1, k


def deal_recorded_twice() -> tuple[ProtocolTrace, int, int]:
    """Hand-tampered: rank 1 records, as its own, ids the same round dealt to rank 0."""
    trace = record_random_trace(core_config(), 0)
    for (_, mine), (k, theirs) in zip(_receives(trace, 0), _receives(trace, 1), strict=True):
        if mine["dealt"]:
            theirs["dealt"] = theirs["dealt"] + mine["dealt"][:1]
            return trace, 1, k
    raise AssertionError("no round dealt rank 0 an id")


BROKEN: dict[str, tuple[Callable[[], tuple[ProtocolTrace, int, int]], str]] = {
    "deal-gives-an-id-to-two-ranks": (overlapping_deal, "TraceDealMatches"),
    "deal-recorded-twice": (deal_recorded_twice, "TraceDealMatches"),
    "exhausts-with-plan-undealt": (dry_when_starved, "TraceExhaustsDealtOut"),
    "observes-an-undealt-id": (observes_undealt, "TraceObservesDealt"),
}


def assert_rejected_for(report: TraceReport, reason: str, rank: int, event: int) -> None:
    assert not report.ok
    assert reason in report.reason, report.reason
    assert f"rank {rank}" in report.reason and re.search(rf"event {event}\b", report.reason), (
        report.reason
    )


@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_runs_fail_the_python_replay_for_their_reason(broken: str) -> None:
    make, reason = BROKEN[broken]
    trace, rank, event = make()
    assert_rejected_for(validate_trace(trace), reason, rank, event)


@pytest.mark.tlc
@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_runs_fail_tlc_for_their_reason(broken: str) -> None:
    require_tlc()
    make, reason = BROKEN[broken]
    trace, rank, event = make()
    assert_rejected_for(validate_trace_tlc(trace), reason, rank, event)


def test_the_broken_machines_break_only_what_they_say() -> None:
    """The honest machines' traces of the same config and seed pass: what fails
    above is the broken deal or source, not the config."""
    assert validate_trace(record_random_trace(core_config(), 0)).ok


# ---- malformed dynamic traces are refused, naming what is wrong ------------------


def test_malformed_dynamic_traces_are_refused_by_both() -> None:
    trace = record_random_trace(core_config(), 0)
    no_deal = copy.deepcopy(trace)
    k, receive = _receives(no_deal, 1)[0]
    del receive["dealt"]
    outside = copy.deepcopy(trace)
    outside.protocol["plan"] = outside.protocol["plan"][1:]
    own_plan = copy.deepcopy(trace)
    own_plan.ranks[0].plan = [0]
    cases = {
        f"rank 1's Receive (event {k})": no_deal,
        "outside the epoch's plan": outside,
        "carry an epoch plan of their own": own_plan,
    }
    for needle, bad in cases.items():
        for which, check in (("python", validate_trace), ("tlc", validate_trace_tlc)):
            report = check(bad)
            assert not report.ok and needle in report.reason, f"{which}: {report.reason}"


def test_a_dynamic_trace_without_its_plan_is_refused() -> None:
    d = record_random_trace(core_config(), 0).to_json()
    del d["protocol"]["plan"]  # as TracingRankMachine recorded before the deals were checked
    report = validate_trace(ProtocolTrace.from_json(d))
    assert not report.ok and "without the epoch's plan" in report.reason


# ---- odb check --trace ----------------------------------------------------------


@pytest.mark.tlc
def test_cli_checks_per_rank_files_of_a_dynamic_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_tlc()
    trace = record_random_trace(core_config(), 2)
    cli_accepts_per_rank_files(trace, tmp_path, capsys)
    bad, _, _ = observes_undealt()
    bad.save(tmp_path / "bad.json")
    assert main(["check", "--trace", str(tmp_path / "bad.json")]) == 1
    printed = capsys.readouterr().out
    assert printed.count("REJECTED: TraceObservesDealt") == 2, printed


# ---- the torch loader's traces (in-process ranks over an in-memory all-gather) -----


def loader_traces(tmp_path: Path, world: int = 2, **kw: Any) -> ProtocolTrace:
    """One epoch of ODBDataLoader(sharding='dynamic', trace_dir=...) on `world`
    in-process ranks (tests/thread_ranks.py), its per-rank trace files merged."""
    torch = pytest.importorskip("torch")
    from thread_ranks import RankLoader, on_ranks, to_the_end

    class Varied(torch.utils.data.Dataset):  # type: ignore[misc]
        def __len__(self) -> int:
            return 30

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": torch.full((1 + (i * 7919) % 13,), i, dtype=torch.int64)}

    def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
        ids = [s["input_ids"] for s in samples]
        return {"input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)}

    def build(transport: Any) -> Any:
        return RankLoader(
            transport,
            Varied(),
            token_budget=24,
            buffer_size=4,
            max_steps_per_round=2,
            collate_fn=collate,
            sharding="dynamic",
            trace_dir=tmp_path,
            **kw,
        )

    results = on_ranks(world, build, to_the_end)
    ids = sorted(i for res in results for i in res.ids)
    assert ids == list(range(30)), "exactly once"
    return ProtocolTrace.merge(sorted(tmp_path.glob("trace-*.json")))


@pytest.mark.torch
@pytest.mark.parametrize("prefetch_thread", [True, False])
def test_a_dynamic_loader_run_passes_the_python_replay(
    tmp_path: Path, prefetch_thread: bool
) -> None:
    trace = loader_traces(tmp_path, world=3, prefetch_thread=prefetch_thread)
    assert trace.protocol["sharding"] == "dynamic" and len(trace.protocol["plan"]) == 30
    assert all(rt.plan is None and rt.scales for rt in trace.ranks)
    report = validate_trace(trace)
    assert report.ok, report.reason
    bad = copy.deepcopy(trace)
    k, receive = next((k, e) for k, e in _receives(bad, 0) if e["dealt"])
    receive["dealt"] = receive["dealt"][1:]  # an id dealt to rank 0 left out of its record
    assert_rejected_for(validate_trace(bad), "TraceDealMatches", 0, k)


@pytest.mark.torch
@pytest.mark.tlc
def test_a_dynamic_loader_run_passes_tlc(tmp_path: Path) -> None:
    require_tlc()
    trace = loader_traces(tmp_path, grad_accum_steps=2)
    report = validate_trace_tlc(trace)
    assert report.ok, report.reason
    bad = copy.deepcopy(trace)
    k = next(k for k, e in enumerate(bad.ranks[1].events) if e["action"] == "Exhaust")
    bad.ranks[1].events.insert(0, bad.ranks[1].events.pop(k))  # dry before it read anything
    assert_rejected_for(validate_trace_tlc(bad), "TraceExhaustsDealtOut", 1, 0)
    assert_rejected_for(validate_trace(bad), "TraceExhaustsDealtOut", 1, 0)
