"""Dynamic sharding on real gloo ranks: 4 ranks where the fixed 1/W split gives
rank 0 every long sample. Each rank loads only the ids the core deals it; the
run is checked for equal steps, exactly-once coverage and identical global
metadata, static vs dynamic, and across a resume at another world size."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import gloo_ranks  # noqa: E402
from test_torch_distributed import assert_exactly_once, check_aligned, step_record  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402

pytestmark = pytest.mark.torch

N = 160
LONG, SHORT = 48, 4  # tokens; the budget (64) holds one long sample


def length_of(i: int) -> int:
    return LONG if i % 4 == 0 else SHORT


class Skewed(Dataset[dict[str, Any]]):
    """Every 4th sample is long, and slower to produce (as preprocessing is):
    round-robin static shards give them all to rank 0."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(0.002 if i % 4 == 0 else 0.0005)
        return {"input_ids": torch.full((length_of(i),), i % 100)}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ids = [s["input_ids"] for s in samples]
    return {"input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)}


def make_loader(spec: dict[str, Any]) -> ODBDataLoader:
    return ODBDataLoader(
        Skewed(),
        collate_fn=collate,
        token_budget=64,
        buffer_size=8,
        max_steps_per_round=4,
        sharding=spec["sharding"],
        num_workers=spec.get("workers", 0),
    )


def _steps(loader: ODBDataLoader, stop_at: int | None = None) -> list[list[Any]]:
    rows = []
    for batch in loader:
        rows.append([*step_record(loader, batch), time.monotonic()])
        if stop_at is not None and len(rows) == stop_at:
            break
    return rows


def run_epochs(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One epoch for each sharding of spec["shardings"], in turn on the same ranks."""
    out = {}
    for sharding in spec["shardings"]:
        out[sharding] = _steps(make_loader({**spec, "sharding": sharding}))
        torch.distributed.barrier()
    return out


def run_phase_a(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    loader = make_loader(spec)
    steps = _steps(loader, spec["stop_at"])
    state = json.loads(json.dumps(loader.state_dict()))
    Path(spec["state_dir"], f"state{rank}.json").write_text(json.dumps(state))
    return {"steps": steps}


def run_phase_b(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    states = [json.loads(p.read_text()) for p in sorted(Path(spec["state_dir"]).glob("s*.json"))]
    loader = make_loader(spec)
    loader.load_state_dict(states)
    return {"steps": _steps(loader)}


def _launch(fn: str, world: int, spec: dict[str, Any], out: Path) -> list[list[list[Any]]]:
    results = gloo_ranks.launch(f"{__name__}:{fn}", world, spec, out)
    for r, res in enumerate(results):
        assert res is not None and res["ok"], f"rank {r}: {res}"
    return [res["steps"] for res in results if res is not None]


def tail(per_rank: list[list[list[Any]]]) -> tuple[int, float]:
    """Steps and seconds from the first pad step on any rank to the epoch's end."""
    first = min((t for rows in per_rank for t, row in enumerate(rows) if row[1]), default=None)
    if first is None:
        return 0, 0.0
    steps = len(per_rank[0]) - first
    start = min(rows[first][-1] for rows in per_rank)
    return steps, max(rows[-1][-1] for rows in per_rank) - start


def test_dynamic_sharding_balances_a_skewed_split_on_four_gloo_ranks(tmp_path: Path) -> None:
    """Static, then dynamic, each a loader of its own, in one launch of 4 ranks."""
    shardings = ("static", "dynamic")
    results = gloo_ranks.launch(f"{__name__}:run_epochs", 4, {"shardings": shardings}, tmp_path)
    for r, res in enumerate(results):
        assert res is not None and res["ok"], f"rank {r}: {res}"
    runs = {sh: [res[sh] for res in results if res is not None] for sh in shardings}
    tails = {}
    for sh, per_rank in runs.items():
        ids = check_aligned([[row[:-1] for row in rows] for rows in per_rank], 4)
        assert_exactly_once(ids, list(range(N)))
        tails[sh] = tail(per_rank)
    # Static: rank 0 holds all 40 long samples (one per step) while the others pad.
    assert len(runs["static"][0]) >= 40 and tails["static"][0] >= 30
    # Dynamic: each rank takes ~10 long samples; the tail is a round (M = 4 steps).
    assert len(runs["dynamic"][0]) <= 16 and tails["dynamic"][0] <= 4
    assert tails["dynamic"][1] < tails["static"][1]
    st, dy = runs["static"][0], runs["dynamic"][0]
    print(f"\nsteps static {len(st)} dynamic {len(dy)}; tail (steps, s) {tails}")


def test_dynamic_sharding_resumes_at_another_world_size(tmp_path: Path) -> None:
    a = _launch(
        "run_phase_a",
        4,
        {"sharding": "dynamic", "stop_at": 3, "state_dir": str(tmp_path), "workers": 1},
        tmp_path / "a",
    )
    before = check_aligned([[row[:-1] for row in rows] for rows in a], 4)
    b = _launch(
        "run_phase_b", 3, {"sharding": "dynamic", "state_dir": str(tmp_path)}, tmp_path / "b"
    )
    after = check_aligned([[row[:-1] for row in rows] for rows in b], 3)
    assert_exactly_once(before + after, list(range(N)))
