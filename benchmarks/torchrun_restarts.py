"""Repeat the torchrun restart case (tests/test_torchrun_restart.py) many times:
two ranks, --max-restarts=1, a rank kill -9'd mid-epoch, resume from the last
checkpoint, finish two epochs. Prints one line per run and a summary (with --json,
one JSON object): passes, replayed steps (bound: the checkpoint interval), wall time.
A pass needs torchrun's exit code 0 (an abort at exit fails the run, issue 31).
With --node-runs N, also the two elastic node cases of tests/test_torchrun_nodes.py
(a node joins, a node leaves; two torchrun launches on 127.0.0.1), N times each.

    .venv/bin/python benchmarks/torchrun_restarts.py --runs 20 --workers 0 2 --node-runs 10
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_torchrun_nodes import (
    test_elastic_size_a_node_joins_and_the_loader_resumes_at_world_two as node_joins,
)
from test_torchrun_nodes import (
    test_elastic_size_a_node_leaves_and_the_loader_resumes_at_world_one as node_leaves,
)
from torchrun_runs import check_run, launch


def one(workers: int, samples: int, every: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        flags = ["--nnodes=1", "--nproc_per_node=2", "--max-restarts=1"]
        args = ["--samples", str(samples), "--every", str(every), "--epochs", "2"]
        args += ["--workers", str(workers), "--kill-rank", "1", "--kill-step", "9"]
        t0 = time.monotonic()
        codes = launch(out, [flags], worker=args)
        wall = time.monotonic() - t0
        try:
            assert codes == [0], f"torchrun exited {codes}"
            facts = check_run(out, samples, 2, every)
            assert facts["worlds"] == [2, 2], f"incarnations {facts['worlds']}"
            return {"ok": True, "wall_s": round(wall, 2), **facts}
        except AssertionError as exc:
            tail = (out / "torchrun0.txt").read_text()[-4000:]
            return {"ok": False, "wall_s": round(wall, 2), "error": str(exc), "log_tail": tail}


def node_case(case: Callable[[Path], None]) -> dict[str, object]:
    """One run of a node test (it asserts every torchrun's exit code 0 and the ids)."""
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        try:
            case(Path(d))
            return {"ok": True, "wall_s": round(time.monotonic() - t0, 2)}
        except AssertionError:
            err = traceback.format_exc()[-4000:]
            return {"ok": False, "wall_s": round(time.monotonic() - t0, 2), "error": err}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--samples", type=int, default=120)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--node-runs", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    summary = {}
    for w in a.workers if a.runs else []:
        runs = [one(w, a.samples, a.every) for _ in range(a.runs)]
        if not a.json:
            for r in runs:
                print(f"workers={w}", json.dumps(r))
        summary[f"workers={w}"] = {
            "passed": sum(bool(r["ok"]) for r in runs),
            "runs": len(runs),
            "max_replayed_steps": max(int(str(r.get("replayed_steps", 0))) for r in runs),
            "checkpoint_interval": a.every,
            "max_wall_s": max(float(str(r["wall_s"])) for r in runs),
        }
    for name, case in (("node_joins", node_joins), ("node_leaves", node_leaves)):
        if not a.node_runs:
            break
        runs = [node_case(case) for _ in range(a.node_runs)]
        if not a.json:
            for r in runs:
                print(name, json.dumps(r))
        summary[name] = {
            "passed": sum(bool(r["ok"]) for r in runs),
            "runs": len(runs),
            "max_wall_s": max(float(str(r["wall_s"])) for r in runs),
        }
    print(json.dumps(summary, indent=None if a.json else 2))


if __name__ == "__main__":
    main()
