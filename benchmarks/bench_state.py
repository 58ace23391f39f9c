"""The resume state at scale: 1,000,000 samples, 500,000 done (a shuffled epoch, so
the done ids are scattered), world size 1. Prints the state's JSON size, the time of
`json.loads`, of `load_state_dict`, of the first batch after it, and the CPU time
of both (targets in issue 20: <= 1 MB, load + first batch <= 0.5 s). With
`--repeat N` every time is the median of N loads, each into a fresh loader.

    .venv/bin/python benchmarks/bench_state.py [--samples 1000000] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import replace
from typing import Any

from odb_core import ODBDataLoader
from odb_core.resume import EpochProgress
from odb_core.torch.sharding import epoch_order


class Tiny:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": [1] * (1 + i % 7)}


def make(n: int) -> ODBDataLoader:
    return ODBDataLoader(
        Tiny(n), token_budget=64, collate_fn=len, shuffle=True, seed=0, prefetch_thread=False
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.repeat < 1:
        p.error(f"--repeat={a.repeat} must be at least 1")
    n, half = a.samples, a.samples // 2
    loader = make(n)
    first = EpochProgress.from_dict(loader.state_dict())
    # the first half of the epoch's shuffled order, as a rank that trained it has done
    order = epoch_order(n, shuffle=True, seed=0, epoch=0)
    done = frozenset(order[:half])
    steps = half // 10
    state = replace(first, step=steps, window=steps, emitted=half, done=done).to_dict()
    text = json.dumps(state)
    runs = [once(n, text) for _ in range(a.repeat)]
    out: dict[str, Any] = {"samples": n, "done": half, "state_bytes": len(text)}
    out["repeat"] = a.repeat
    for key in runs[0]:
        out[key] = round(statistics.median(r[key] for r in runs), 3)
    if a.repeat > 1:
        out["load_plus_first_batch_s_all"] = [round(r["load_plus_first_batch_s"], 3) for r in runs]
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))


def once(n: int, text: str) -> dict[str, float]:
    """One load of the state `text` into a fresh loader, and its first batch."""
    gc.collect()  # not the garbage of the run before
    t0 = time.perf_counter()
    parsed: Any = json.loads(text)
    t1 = time.perf_counter()
    fresh = make(n)
    c1 = time.process_time()
    fresh.load_state_dict(parsed)
    t2 = time.perf_counter()
    it = iter(fresh)
    next(it)
    t3 = time.perf_counter()
    c3 = time.process_time()
    return {
        "json_loads_s": t1 - t0,
        "load_state_dict_s": t2 - t1,
        "first_batch_s": t3 - t2,
        "load_plus_first_batch_s": t3 - t1,
        # CPU seconds of this process: what the wall time is on a quiet machine, and
        # much less moved by other jobs on a shared one
        "load_plus_first_batch_cpu_s": c3 - c1,
    }


if __name__ == "__main__":
    main()
