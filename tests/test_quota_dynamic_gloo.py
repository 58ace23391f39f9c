"""Quota mode with dynamic sharding on 2 real gloo ranks (spawned processes), plus
a merged resume: the first pass closes at the step the global count reaches the
quota and carries every id it did not emit (the same ledger on both ranks); the
second pass starts from that ledger, is interrupted, resumed from the merged
state, and closes exactly too, every id of it emitted once or carried; the
first pass's traces and the resumed incarnation's pass both checkers.
In-process variants and the traces: tests/test_quota_dynamic.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import gloo_ranks  # noqa: E402
from test_tlc import require_tlc  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.verify.tlc.trace_check import validate_trace_tlc  # noqa: E402
from odb_core.verify.trace_validation import ProtocolTrace, validate_trace  # noqa: E402

pytestmark = pytest.mark.torch

N, QUOTA = 40, 24


class Text(Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": torch.zeros(1 + (i * 7919) % 23, dtype=torch.int64)}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ids = [s["input_ids"] for s in samples]
    return {"input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)}


def make_loader(spec: dict[str, Any]) -> ODBDataLoader:
    return ODBDataLoader(
        Text(),
        collate_fn=collate,
        token_budget=64,
        buffer_size=3,
        max_steps_per_round=2,
        mode="quota",
        quota=QUOTA,
        shuffle=True,
        sharding="dynamic",
        trace_dir=Path(spec["dir"], "traces"),
    )


def _pass(loader: ODBDataLoader, epoch: int, stop: int | None = None) -> list[list[Any]]:
    loader.set_epoch(epoch)
    rows = []
    for _ in loader:
        info = loader.step_info
        assert info is not None
        rows.append([info.step, info.global_samples, list(info.sample_ids)])
        if stop is not None and len(rows) == stop:
            break
    return rows


def run_a(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    loader = make_loader(spec)
    first = _pass(loader, 0)
    out = {"first": first, "ledger": list(loader.ledger)}
    second = _pass(loader, 1, stop=spec["stop"])
    Path(spec["dir"], f"state{rank}.json").write_text(json.dumps(loader.state_dict()))
    return {**out, "second": second, "carried_in": list(loader.carried_in)}


def run_b(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    states = [json.loads(p.read_text()) for p in sorted(Path(spec["dir"]).glob("state*.json"))]
    loader = make_loader(spec)
    loader.load_state_dict(states)
    rows = []
    for _ in loader:
        info = loader.step_info
        assert info is not None
        rows.append([info.step, info.global_samples, list(info.sample_ids)])
    return {"rest": rows, "ledger": list(loader.ledger)}


def _ok(results: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    for r, res in enumerate(results):
        assert res is not None and res["ok"], f"rank {r}: {res}"
    return [res for res in results if res is not None]


def check_pass(per_rank: list[list[list[Any]]], ledgers: list[list[int]]) -> list[int]:
    """Aligned steps, the quota met at the last step and not before, every id of the
    pass emitted once or in the one ledger. Returns the ledger."""
    assert len({len(rows) for rows in per_rank}) == 1, "equal steps on every rank"
    counts = [row[1] for row in per_rank[0]]
    assert all([row[1] for row in rows] == counts for rows in per_rank), "one global count"
    assert sum(counts) >= QUOTA > sum(counts[:-1]), "closed at the step the quota was met"
    emitted = [i for rows in per_rank for row in rows for i in row[2]]
    assert sum(counts) == len(emitted)
    assert all(ledger == ledgers[0] for ledger in ledgers), "one ledger"
    assert ledgers[0], "the quota carried nothing: this checks nothing"
    assert sorted(emitted + ledgers[0]) == list(range(N)), "each id once, or carried"
    return ledgers[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any], list[Any]]:
    """Phase a (2 gloo ranks: the first pass, then 2 steps of the second, states
    saved) and phase b (2 gloo ranks resume the merged state and finish)."""
    tmp = tmp_path_factory.mktemp("quota_dynamic")
    spec = {"dir": str(tmp), "stop": 2}
    a = _ok(gloo_ranks.launch(f"{__name__}:run_a", 2, spec, tmp / "a"))
    b = _ok(gloo_ranks.launch(f"{__name__}:run_b", 2, spec, tmp / "b"))
    return tmp, a, b


def test_quota_passes_and_a_merged_resume_on_two_gloo_ranks(
    runs: tuple[Path, list[Any], list[Any]],
) -> None:
    _, a, b = runs
    ledger = check_pass([r["first"] for r in a], [r["ledger"] for r in a])
    assert all(r["carried_in"] == ledger for r in a)
    assert all(r["rest"][0][0] == 2 for r in b), "the resume starts at the saved step"
    second = [r["second"] + rest["rest"] for r, rest in zip(a, b, strict=True)]
    check_pass(second, [r["ledger"] for r in b])


def traces(tmp: Path) -> dict[str, ProtocolTrace]:
    """The first pass's traces and the resumed incarnation's of the second."""
    out = {}
    for run in ("epoch0-step0", "epoch1-step2"):
        out[run] = ProtocolTrace.merge(sorted(tmp.glob(f"traces/trace-{run}-rank*.json")))
        assert len(out[run].ranks) == 2
    return out


def test_the_runs_traces_pass_the_python_replay(runs: tuple[Path, list[Any], list[Any]]) -> None:
    for run, trace in traces(runs[0]).items():
        report = validate_trace(trace)
        assert report.ok, f"{run}: {report.reason}"


@pytest.mark.tlc
def test_the_runs_traces_pass_tlc(runs: tuple[Path, list[Any], list[Any]]) -> None:
    require_tlc()
    for run, trace in traces(runs[0]).items():
        report = validate_trace_tlc(trace)
        assert report.ok, f"{run}: {report.reason}"
