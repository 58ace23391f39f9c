"""Early forms on two real gloo ranks (spawned processes), each with a forked
DataLoader worker and a slow dataset: exactly once, the same steps on every rank,
and the recorded trace accepted by the Python replay and by TLC.

In the forced run every enabled FORM_EARLY is taken (the observation is patched in
the rank process), so that early forms happen whatever the timing; the other run
keeps the real observation (the look-ahead reader's queue and arrival rate), where
only the guarantees, which hold either way, are asserted.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from guards import HANG_GUARD_S

torch = pytest.importorskip("torch")

import gloo_ranks  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.verify.tlc import validate_trace_tlc  # noqa: E402
from odb_core.verify.trace_validation import ProtocolTrace, validate_trace  # noqa: E402

pytestmark = pytest.mark.torch

N = 96


class Slow(Dataset[dict[str, Any]]):
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(self.delay)
        return {"input_ids": torch.full((1 + (i * 7919) % 29,), i, dtype=torch.int64)}


def ids_of(samples: list[dict[str, Any]]) -> list[int]:
    return [int(s["input_ids"][0]) for s in samples]


def run_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    if spec["force"]:
        from odb_core.torch import rounds

        rounds.early_form_decision = lambda *a: True  # type: ignore[assignment]
    if spec.get("broken"):
        from odb_core.protocol import RankMachine

        form_early = RankMachine.form_early

        def dropping_the_rest(self: RankMachine) -> Any:  # broken on purpose
            batches = form_early(self)
            if batches:
                self.buffer = {}
            return batches

        RankMachine.form_early = dropping_the_rest  # type: ignore[method-assign]
    loader = ODBDataLoader(
        Slow(spec["n"], spec["delay"]),
        token_budget=64,
        cost_model="padded",
        buffer_size=16,
        max_steps_per_round=2,
        early_form=4,
        early_form_wait=0.0,
        collate_fn=ids_of,
        step_meta=False,
        num_workers=1,
        multiprocessing_context="fork",
        samples_per_fetch=1,
        trace_dir=spec["trace_dir"],
    )
    steps, pads, ids = [], 0, []
    for batch in loader:
        info = loader.step_info
        assert info is not None
        steps.append(info.step)
        pads += info.is_pad
        ids.extend(batch if not info.is_pad else [])
        assert info.is_pad or sorted(batch) == sorted(info.sample_ids)
    loader.close()
    return {"steps": steps, "pads": pads, "ids": ids}


def launch(spec: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    results = gloo_ranks.launch(f"{__name__}:run_rank", 2, spec, out, HANG_GUARD_S)
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} wrote no result"
        assert res["ok"], f"rank {r} failed: {res['error']}"
    return [r for r in results if r is not None]


def assert_aligned_exactly_once(results: list[dict[str, Any]], n: int) -> None:
    a, b = results
    assert a["steps"] == b["steps"] == list(range(len(a["steps"])))
    ids = a["ids"] + b["ids"]
    assert len(ids) == len(set(ids)), "a sample id was emitted twice"
    assert sorted(ids) == list(range(n)), f"missing {sorted(set(range(n)) - set(ids))[:10]}"


@pytest.fixture(scope="module")
def forced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("forced")
    spec = {"n": N, "delay": 0.002, "force": True, "trace_dir": str(out / "trace")}
    assert_aligned_exactly_once(launch(spec, out), N)
    return out / "trace"


def early_forms(trace: ProtocolTrace) -> list[int]:
    return [sum(e["action"] == "FormEarly" for e in rt.events) for rt in trace.ranks]


def test_forced_early_forms_on_gloo_ranks_keep_exactly_once_and_the_trace_replays(
    forced: Path,
) -> None:
    trace = ProtocolTrace.merge(sorted(forced.glob("*.json")))
    assert len(trace.ranks) == 2 and all(c > 0 for c in early_forms(trace)), early_forms(trace)
    report = validate_trace(trace)
    assert report.ok, report.reason


@pytest.mark.tlc
def test_forced_early_forms_on_gloo_ranks_pass_the_tlc_trace_check(forced: Path) -> None:
    report = validate_trace_tlc(ProtocolTrace.merge(sorted(forced.glob("*.json"))))
    assert report.ok, report.reason


def test_the_real_observation_on_gloo_ranks_keeps_every_guarantee(tmp_path: Path) -> None:
    spec = {"n": N, "delay": 0.003, "force": False, "trace_dir": str(tmp_path / "trace")}
    assert_aligned_exactly_once(launch(spec, tmp_path), N)
    report = validate_trace(ProtocolTrace.merge(sorted((tmp_path / "trace").glob("*.json"))))
    assert report.ok, report.reason


def test_an_early_form_that_loses_samples_on_gloo_ranks_is_caught(tmp_path: Path) -> None:
    spec = {"n": N, "delay": 0.0, "force": True, "broken": True, "trace_dir": None}
    with pytest.raises(AssertionError, match="missing"):
        assert_aligned_exactly_once(launch(spec, tmp_path), N)
