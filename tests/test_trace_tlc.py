"""Trace validation through TLC: recorded runs of TracingRankMachine are inlined
into a Trace module and replayed through spec/DGAP.tla; corrupted ones are rejected."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_tlc import BY_NAME, require_tlc

from odb_core.cli import main
from odb_core.errors import ConfigError
from odb_core.formers import FormerKind
from odb_core.verify.conformance import record_random_trace
from odb_core.verify.model import ModelConfig
from odb_core.verify.tlc.trace_check import _trace_log, linearize, validate_trace_tlc
from odb_core.verify.trace_validation import ProtocolTrace, validate_trace

CONFIGS = [
    "MCjoin_w3_n6_k1",
    "MCquota_w2_n8_k2_q3",
    "MCjoin_w2_n7_k3_padded",
    "MCjoin_w2_n6_k2_det",
    "MCquota_w3_n8_k3",
    "MCbounds_w2_n5_k1",
    "MCjoin_w2_n5_k1_g2",
    "MCjoin_w3_n6_k1_t3",
    "MCquota_w2_n8_k2_g2_q3",
    "MCquota_w2_n6_k2_q3_carry",
]


def recorded(name: str, seed: int) -> ProtocolTrace:
    return record_random_trace(BY_NAME[name].model_config(), seed)


def test_linearisation_keeps_rank_order_and_the_rendezvous() -> None:
    c, r, o = ({"action": a} for a in ("Contribute", "Receive", "Observe"))
    order = linearize([[o, c, o, r, c, r], [c, r, o, c, r]])
    assert order == [
        (0, 0), (0, 1), (1, 0), (None, -1), (0, 2), (0, 3), (1, 1),
        (0, 4), (1, 2), (1, 3), (None, -1), (0, 5), (1, 4),
    ]  # fmt: skip


@pytest.mark.tlc
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_recorded_traces_are_accepted(name: str, seed: int) -> None:
    require_tlc()
    trace = recorded(name, seed)
    python = validate_trace(trace)
    assert python.ok, python.reason
    report = validate_trace_tlc(trace)
    assert report.ok, report.reason
    assert sorted(report.actions) == sorted(python.actions)
    assert report.model is not None and report.model.shards == python.model.shards  # type: ignore[union-attr]


def _events(trace: ProtocolTrace, rank: int, action: str) -> list[dict[str, Any]]:
    return [e for e in trace.ranks[rank].events if e["action"] == action]


def _bump_vector(t: ProtocolTrace) -> None:
    _events(t, 0, "Contribute")[0]["vector"][2] += 1  # samples of the first offered batch


def _bump_loss_tokens(t: ProtocolTrace) -> None:
    m = t.protocol["max_steps_per_round"]
    vector = next(e["vector"] for e in _events(t, 0, "Contribute") if e["vector"][0] > 0)
    vector[2 + 2 * m] += 1  # loss tokens of the first offered batch


def _flip_window_boundary(t: ProtocolTrace) -> None:
    receive = next(e for e in _events(t, 0, "Receive") if e["steps"])
    receive["sync"][0] = not receive["sync"][0]


def _swap_emitted_batch(t: ProtocolTrace) -> None:
    receive = next(e for e in _events(t, 1, "Receive") if any(e["steps"]))
    step = next(s for s in receive["steps"] if s)
    theirs = next(e["sample"][0] for e in _events(t, 0, "Observe"))
    step[0] = theirs  # a sample of rank 0, emitted by rank 1


def _flip_done(t: ProtocolTrace) -> None:
    _events(t, 0, "Receive")[0]["done"] = not _events(t, 0, "Receive")[0]["done"]


def _drop_last_receive(t: ProtocolTrace) -> None:
    events = t.ranks[2].events
    del events[max(i for i, e in enumerate(events) if e["action"] == "Receive")]


def _form_before_observe(t: ProtocolTrace) -> None:
    events = t.ranks[1].events
    i = next(i for i, e in enumerate(events) if e["action"] == "Form")
    events[i - 1], events[i] = events[i], events[i - 1]


def _pad_as_real(t: ProtocolTrace) -> None:
    for rt in t.ranks:
        for e in rt.events:
            if e["action"] == "Receive" and None in e["steps"]:
                own = next(o["sample"][0] for o in rt.events if o["action"] == "Observe")
                e["steps"][e["steps"].index(None)] = [own]  # a pad reported as a real batch
                return
    raise AssertionError("no pad step in this trace")


CORRUPTIONS: dict[str, Callable[[ProtocolTrace], None]] = {
    "vector": _bump_vector,
    "loss-tokens": _bump_loss_tokens,
    "window-boundary": _flip_window_boundary,
    "emitted-batch": _swap_emitted_batch,
    "done-flag": _flip_done,
    "missing-receive": _drop_last_receive,
    "reordered": _form_before_observe,
    "pad-as-real": _pad_as_real,
}


def corruption_base(corruption: str) -> tuple[str, int]:
    """The recorded run (model, seed) that `corruption` is applied to."""
    if corruption in ("loss-tokens", "window-boundary"):
        return "MCjoin_w3_n6_k1_t3", 5
    if corruption == "pad-as-real":  # the first seed whose run has a pad step
        return "MCbounds_w2_n5_k1", next(
            s
            for s in range(20)
            for t in [recorded("MCbounds_w2_n5_k1", s)]
            if any(None in e.get("steps", ()) for rt in t.ranks for e in rt.events)
        )
    return "MCjoin_w3_n6_k1", 5


@functools.cache
def tlc_accepts(name: str, seed: int) -> bool:
    """TLC's verdict on an uncorrupted recorded run, once per run (several
    corruptions start from the same one)."""
    return validate_trace_tlc(recorded(name, seed)).ok


@pytest.mark.tlc
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupted_traces_are_rejected(corruption: str) -> None:
    require_tlc()
    name, seed = corruption_base(corruption)
    assert tlc_accepts(name, seed)
    trace = recorded(name, seed)
    bad = copy.deepcopy(trace)
    CORRUPTIONS[corruption](bad)
    report = validate_trace_tlc(bad)
    assert not report.ok
    assert report.reason, "a rejection says where"
    assert not validate_trace(bad).ok, "the Python replay rejects it too"


def cli_accepts_per_rank_files(
    trace: ProtocolTrace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`odb check --trace` on one file per rank of `trace`: both engines accept it."""
    files = []
    for rt in trace.ranks:
        path = tmp_path / f"rank{rt.rank}.json"
        ProtocolTrace(trace.protocol, [rt]).save(path)
        files.append(str(path))
    assert main(["check", "--trace", *files, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["python"]["ok"] and out["tlc"]["ok"]


@pytest.mark.tlc
def test_cli_validates_per_rank_trace_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_tlc()
    trace = recorded("MCjoin_w3_n6_k1", 3)
    cli_accepts_per_rank_files(trace, tmp_path, capsys)
    bad = copy.deepcopy(trace)
    _bump_vector(bad)
    bad.save(tmp_path / "bad.json")
    assert main(["check", "--trace", str(tmp_path / "bad.json"), "--engine", "tlc"]) == 1
    assert "REJECTED" in capsys.readouterr().out


@pytest.mark.tlc
def test_a_run_the_spec_does_not_model_is_reported() -> None:
    require_tlc()
    cfg: ModelConfig = BY_NAME["MCjoin_w2_n4_k1"].model_config()
    cfg = replace(cfg, protocol=replace(cfg.protocol, former=FormerKind.BEST_FIT_DECREASING))
    report = validate_trace_tlc(record_random_trace(cfg, 0))
    assert not report.ok and "does not model" in report.reason


def test_traces_carry_loss_tokens_and_window_boundaries() -> None:
    trace = recorded("MCjoin_w2_n5_k1_g2", 0)
    m = BY_NAME["MCjoin_w2_n5_k1_g2"]
    assert trace.protocol["grad_accum_steps"] == 2
    observed = [e["sample"] for rt in trace.ranks for e in rt.events if e["action"] == "Observe"]
    assert m.loss is not None
    assert sorted((s[0], s[4]) for s in observed) == list(enumerate(m.loss))
    receives = [e for e in trace.ranks[0].events if e["action"] == "Receive"]
    assert all(len(e["sync"]) == len(e["steps"]) for e in receives)
    assert sum(x for e in receives for x in e["sync"]) >= 1
    assert validate_trace(trace).ok


@pytest.mark.tlc
def test_traces_without_boundaries_still_validate() -> None:
    """4-field samples (every token counts) and no `sync` are accepted; a version-1
    trace (vectors without loss tokens) is refused by its version."""
    require_tlc()
    trace = recorded("MCjoin_w3_n6_k1", 2)
    for rt in trace.ranks:
        for e in rt.events:
            if e["action"] == "Observe":
                e["sample"] = e["sample"][:4]
            e.pop("sync", None)
    report = validate_trace(trace)
    assert report.ok, report.reason
    _, literals = _trace_log(trace, report.id_map, trace.protocol["max_steps_per_round"])
    assert any(lit.startswith("Rcv(") for lit in literals)
    assert not any(lit.startswith("RcvW(") for lit in literals)
    tlc_report = validate_trace_tlc(trace)
    assert tlc_report.ok, tlc_report.reason
    with pytest.raises(ConfigError, match="version 1"):
        ProtocolTrace.from_json({**trace.to_json(), "version": 1})


def test_python_validator_rejects_an_unknown_emitted_id() -> None:
    from odb_core.config import ProtocolConfig
    from odb_core.cost import Budget
    from odb_core.sample import Sample
    from odb_core.verify.trace_validation import ProtocolTrace, TracingRankMachine, validate_trace

    m = TracingRankMachine(0, ProtocolConfig(world_size=1, budget=Budget(10), buffer_size=2))
    source = iter([Sample(0, 3), Sample(1, 4)])
    done = False
    while not done:
        done = m.all_gather([m.fill(lambda: next(source, None))]).done
    trace = ProtocolTrace.from_machines([m])
    receive = next(e for e in trace.ranks[0].events if e["action"] == "Receive")
    receive["steps"][0] = [*receive["steps"][0], 99]
    report = validate_trace(trace)
    assert not report.ok and "99" in report.reason


# ---- fast: the Python replay alone, no TLC --------------------------------------------


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupted_traces_are_rejected_by_the_python_replay(corruption: str) -> None:
    trace = recorded(*corruption_base(corruption))
    assert validate_trace(trace).ok
    bad = copy.deepcopy(trace)
    CORRUPTIONS[corruption](bad)
    report = validate_trace(bad)
    assert not report.ok and report.reason
    if corruption in ("vector", "loss-tokens"):
        assert "vector" in report.reason


def _with_plan_dropping_one(name: str, seed: int) -> tuple[ProtocolTrace, int]:
    """A run whose sampler silently dropped the last sample: the run itself is a
    behaviour of the model (on the samples it saw), but its plan names the sample."""
    full: ModelConfig = BY_NAME[name].model_config()
    dropped = full.n_samples - 1
    shards = tuple(tuple(s for s in shard if s.id != dropped) for shard in full.shards)
    trace = record_random_trace(replace(full, shards=shards), seed)
    for rt, shard in zip(trace.ranks, full.shards, strict=True):
        rt.plan = [s.id for s in shard]
    return trace, dropped


def test_traces_carry_the_plan_the_global_counts_and_version_3() -> None:
    trace = recorded("MCjoin_w3_n6_k1", 1)
    receives = [e for rt in trace.ranks for e in rt.events if e["action"] == "Receive"]
    assert all(len(e["global"]) == len(e["steps"]) for e in receives)
    d = json.loads(json.dumps(trace.to_json()))
    assert d["version"] == 3
    with pytest.raises(ConfigError, match=r"version 2, expected 3: version 2 traces carry no"):
        ProtocolTrace.from_json({**d, "version": 2})
    shards = BY_NAME["MCjoin_w3_n6_k1"].model_config().shards
    for rt, shard in zip(trace.ranks, shards, strict=True):
        rt.plan = [s.id for s in shard]
    again = ProtocolTrace.from_json(json.loads(json.dumps(trace.to_json())))
    assert [rt.plan for rt in again.ranks] == [rt.plan for rt in trace.ranks]
    assert validate_trace(again).ok


def test_a_dropped_sample_is_rejected_by_the_python_replay() -> None:
    trace, dropped = _with_plan_dropping_one("MCjoin_w3_n6_k1", 0)
    report = validate_trace(trace)
    assert not report.ok and f"never observed ids [{dropped}]" in report.reason
    for rt in trace.ranks:
        rt.plan = None
    assert validate_trace(trace).ok, "without its plan the same run looks complete"


def test_wrong_global_counts_are_rejected_by_the_python_replay() -> None:
    trace = recorded("MCjoin_w3_n6_k1_t3", 2)
    receive = next(e for e in _events(trace, 0, "Receive") if e["steps"])
    receive["global"][0][2] += 1
    report = validate_trace(trace)
    assert not report.ok and "global counts" in report.reason


@pytest.mark.tlc
@pytest.mark.parametrize(("name", "seed"), [("MCjoin_w3_n6_k1", 0), ("MCjoin_w2_n6_k2_det", 1)])
def test_a_dropped_sample_is_rejected_by_tlc(name: str, seed: int) -> None:
    require_tlc()
    trace, _ = _with_plan_dropping_one(name, seed)
    report = validate_trace_tlc(trace)
    assert not report.ok and "not a step of DGAP" in report.reason
    for rt in trace.ranks:
        rt.plan = None
    assert validate_trace_tlc(trace).ok


@pytest.mark.tlc
def test_wrong_global_counts_are_rejected_by_tlc() -> None:
    require_tlc()
    trace = recorded("MCjoin_w3_n6_k1_t3", 2)
    assert validate_trace_tlc(trace).ok
    receive = next(e for e in _events(trace, 0, "Receive") if e["steps"])
    receive["global"][0][0] += 1
    report = validate_trace_tlc(trace)
    assert not report.ok and "not a step of DGAP" in report.reason
