"""Early forms in the torch loader (issue 24): first batch, epoch time and padding.

    .venv/bin/python benchmarks/early_forms.py [--samples 6000] [--repeats 3]

One process (no peers), padded cost, a map-style dataset of log-normal lengths
whose preprocessing is slow and I/O-bound (`--prep-ms` of sleep per sample, on
`--workers` forked DataLoader workers), and a training step that sleeps in
proportion to the batch's padded tokens (`--step-us-per-token`), so the run is
data-bound at its start and CPU-light on a shared machine. Variants, interleaved
per repeat (medians): the padded default window (1,024), a 4,096 window, and each
with `early_form=128` (`early_form_wait` 0.25 s); `--variant NAME` (repeatable)
runs only those. Reported: seconds to the first batch, epoch wall seconds,
padding `1 - real / padded tokens`, steps, and the seconds the training loop
waited for a batch (`EpochStats.stall_s`; the first batch's wait included).
`--profile` adds the protocol thread's CPU seconds, the former runs (full and
early forms) and their CPU seconds (thread time, so waits are not counted).
`--compare-read-ahead` runs every variant twice per repeat, interleaved: as is,
and with the protocol thread's read ahead at the gate off (the pipeline before
it had one; same batches, see tests/test_pipeline_readahead.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from typing import Any

import torch
from torch.utils.data import Dataset

from odb_core import ODBDataLoader

VARIANTS: dict[str, dict[str, Any]] = {
    "window 1024": {"buffer_size": 1024},
    "window 1024, early 128": {"buffer_size": 1024, "early_form": 128},
    "window 4096": {"buffer_size": 4096},
    "window 4096, early 128": {"buffer_size": 4096, "early_form": 128},
}


class SlowText(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, mean_len: int, prep_s: float, seed: int = 0) -> None:
        rng = random.Random(seed)
        sigma = 0.8
        mu = math.log(mean_len) - sigma * sigma / 2
        self.lengths = [
            max(1, min(8 * mean_len, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)
        ]
        self.prep_s = prep_s

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(self.prep_s)
        return {"input_ids": torch.full((self.lengths[i],), i % 1000)}


def lengths_only(samples: list[dict[str, torch.Tensor]]) -> list[int]:
    return [len(s["input_ids"]) for s in samples]


PROFILE: dict[str, float] = {}  # --profile: the current run's counters


def instrument() -> None:
    """Count the former's runs and CPU time, and the protocol thread's CPU time."""
    import odb_core.protocol as protocol
    from odb_core.torch import pipeline

    former = vars(protocol)["carried_first"]  # the name protocol looks up, patched below
    loop = pipeline.EpochPipeline._run

    def timed_former(*a: Any, **k: Any) -> Any:
        start = time.thread_time()
        try:
            return former(*a, **k)
        finally:
            PROFILE["forms"] += 1
            PROFILE["former_cpu_s"] += time.thread_time() - start

    def timed_loop(self: Any) -> None:
        start = time.thread_time()
        try:
            loop(self)
        finally:
            PROFILE["protocol_cpu_s"] += time.thread_time() - start

    vars(protocol)["carried_first"] = timed_former
    pipeline.EpochPipeline._run = timed_loop  # type: ignore[method-assign]


def no_read_ahead(self: Any) -> int:
    return 0


def run(ds: SlowText, args: argparse.Namespace, kw: dict[str, Any]) -> dict[str, float]:
    PROFILE.update(forms=0, former_cpu_s=0.0, protocol_cpu_s=0.0)
    from odb_core.torch.pipeline import EpochPipeline

    kw = dict(kw)
    room = EpochPipeline._read_ahead_room
    if kw.pop("read_ahead", True) is False:
        EpochPipeline._read_ahead_room = no_read_ahead  # type: ignore[method-assign]
    try:
        return _run(ds, args, kw)
    finally:
        EpochPipeline._read_ahead_room = room  # type: ignore[method-assign]


def _run(ds: SlowText, args: argparse.Namespace, kw: dict[str, Any]) -> dict[str, float]:
    loader = ODBDataLoader(
        ds,
        token_budget=args.budget,
        cost_model="padded",
        collate_fn=lengths_only,
        step_meta=False,
        num_workers=args.workers,
        multiprocessing_context="fork",
        shuffle=True,
        **kw,
    )
    start = time.perf_counter()
    first = None
    real = padded = steps = 0
    for lengths in loader:
        if first is None:
            first = time.perf_counter() - start
        steps += 1
        real += sum(lengths)
        padded += len(lengths) * max(lengths)
        time.sleep(len(lengths) * max(lengths) * args.step_us_per_token / 1e6)
    wall = time.perf_counter() - start
    stall = loader.epoch_stats.stall_s if loader.epoch_stats is not None else math.nan
    loader.close()
    return {
        "first_s": first or 0.0,
        "wall_s": wall,
        "padding": 1 - real / padded,
        "steps": steps,
        "stall_s": stall,
        **(dict(PROFILE) if args.profile else {}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=6000)
    p.add_argument("--mean-len", type=int, default=128)
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--prep-ms", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-us-per-token", type=float, default=6.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variant", action="append", choices=list(VARIANTS), default=None)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--compare-read-ahead", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.profile:
        instrument()
    ds = SlowText(args.samples, args.mean_len, args.prep_ms / 1e3)
    variants = {name: VARIANTS[name] for name in args.variant or VARIANTS}
    if args.compare_read_ahead:
        variants = {
            f"{name}{tag}": {**kw, "read_ahead": on}
            for name, kw in variants.items()
            for tag, on in ((", no read ahead", False), ("", True))
        }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for name, kw in variants.items():
            runs[name].append(run(ds, args, kw))
            loads.append(os.getloadavg()[0])
    out: dict[str, Any] = {
        "params": vars(args),
        "load": os.getloadavg(),
        "load_range": (min(loads), max(loads)),
        "medians": {
            name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            for name, rs in runs.items()
        },
        "runs": runs,
    }
    if args.json:
        print(json.dumps(out))
        return
    lo, hi = out["load_range"]
    print(f"load average {lo:.2f}-{hi:.2f} (1 min, between runs); medians of {args.repeats}")
    print("| variant | first batch s | epoch s | padding | steps | loop waited s |")
    print("|---|---|---|---|---|---|")
    for name, m in out["medians"].items():
        print(
            f"| {name} | {m['first_s']:.2f} | {m['wall_s']:.2f} | {m['padding']:.1%} | "
            f"{m['steps']:.0f} | {m['stall_s']:.2f} |"
            + (
                f" protocol thread {m['protocol_cpu_s']:.2f} s CPU, {m['forms']:.0f} forms "
                f"{m['former_cpu_s']:.3f} s CPU |"
                if args.profile
                else ""
            )
        )


if __name__ == "__main__":
    main()
