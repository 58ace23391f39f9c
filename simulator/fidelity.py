"""The simulator's fidelity check: predict a measured `odb bench --model
qwen3-vl-tiny` run's ratios with the simulator, the bench's own data and a CPU
profile fitted to another run (`simulator.bench_fit`), and compare.

The simulator runs its own strategies (`standard`, `grouped`, `gmt`, `odb` with
the padded cost model, every batch padded as the bench collates) with the
bench's ranks, budget, fixed batch, DataLoader workers and odb window, over
several simulator seeds (its data orders), medians of paired ratios, as the
bench reports its repeats. grouped's and gmt's length pass is the fitted
preprocessing of a rank's half of the samples, added to their epoch.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from odb_core.config import default_buffer_size
from odb_core.cost import CostKind
from simulator.bench_fit import pass_s
from simulator.bench_workload import BenchSamples, bench_workload
from simulator.cpu_profile import CPUProfile
from simulator.engine import SimConfig, simulate

# (ratio, the simulator's baseline, the bench's ratio key, pass counted)
RATIOS: tuple[tuple[str, str, str, bool], ...] = (
    ("odb/standard", "standard", "odb-padded/standard", False),
    ("odb/grouped, pass counted", "grouped", "odb-padded/grouped_incl_length_pass", True),
    ("odb/gmt, pass counted", "gmt", "odb-padded/gmt_incl_precompute", True),
)
_RATE = {False: "samples_per_s", True: "samples_per_s_incl_precompute"}
PREFETCH_FACTOR = 2  # torch DataLoader's default, which the bench keeps


def predict(
    profile: CPUProfile,
    counts: BenchSamples,
    params: dict[str, Any],
    sim_seeds: Sequence[int] = (0, 1, 2, 3, 4),
) -> dict[str, Any]:
    """The bench's three ratios as the simulator predicts them for `params` (the
    measured run's `params`) over `counts` (its samples)."""
    world = int(params["ranks"])
    workload = bench_workload(counts, profile.worker_prep)
    length_pass = pass_s(profile.prep, counts.visual, world)
    buffer = params.get("buffer_size") or default_buffer_size(CostKind.PADDED)
    per_seed: dict[str, list[float]] = {name: [] for name, *_ in RATIOS}
    walls: dict[str, list[float]] = {}
    waits: dict[str, list[float]] = {}
    for seed in sim_seeds:
        cfg = SimConfig(
            workload=workload,
            ranks=world,
            hardware=profile,  # type: ignore[arg-type]  # the trainer's interface
            strategies=("standard", "grouped", "gmt", "odb"),
            seed=seed,
            budget=int(params["budget"]),
            batch_size=int(params["fixed_batch"]),
            cost=CostKind.PADDED,
            buffer_size=int(buffer),
            num_workers=max(1, int(params["workers"])),
            prefetch_factor=PREFETCH_FACTOR,
        )
        out = simulate(cfg)
        if not out["ok"]:
            raise RuntimeError(f"simulator seed {seed}: violations in {out['strategies']}")
        m = out["strategies"]
        for name, metrics in m.items():
            walls.setdefault(name, []).append(float(metrics["wall_s"]))
            waits.setdefault(name, []).append(float(metrics["data_wait_s"]))
        odb = float(m["odb"]["samples_per_s"])
        for name, base, _, with_pass in RATIOS:
            wall = float(m[base]["wall_s"]) + (length_pass if with_pass else 0.0)
            per_seed[name].append(odb / (counts.n / wall))
    return {
        "ratios": {k: float(statistics.median(v)) for k, v in per_seed.items()},
        "per_seed": per_seed,
        "wall_s": {k: float(statistics.median(v)) for k, v in walls.items()},
        "data_wait_s": {k: float(statistics.median(v)) for k, v in waits.items()},
        "length_pass_s": length_pass,
        "sim_seeds": list(sim_seeds),
    }


def measured(result: dict[str, Any]) -> dict[str, Any]:
    """The bench run's own paired-median ratios and epoch times."""
    ratios = result["ratios"]
    missing = [key for _, _, key, _ in RATIOS if key not in ratios]
    if missing:
        raise ValueError(f"the bench JSON has no ratio {missing[0]!r}: run its default strategies")
    names = {"standard": "standard", "grouped": "grouped", "gmt": "gmt", "odb": "odb-padded"}
    runs = {k: result["strategies"][v]["runs"] for k, v in names.items()}
    per_repeat = {
        name: [
            float(o["samples_per_s"]) / float(b[_RATE[with_pass]])
            for o, b in zip(runs["odb"], runs[base], strict=True)
        ]
        for name, base, _, with_pass in RATIOS
    }
    return {
        "ratios": {name: float(ratios[key]) for name, _, key, _ in RATIOS},
        "per_repeat": per_repeat,
        "wall_s": {k: float(result["strategies"][v]["wall_s"]) for k, v in names.items()},
        "data_wait_s": {k: float(result["strategies"][v]["data_wait_s"]) for k, v in names.items()},
        "length_pass_s": statistics.median(
            float(result["strategies"][s]["precompute_s"]) for s in ("grouped", "gmt")
        ),
    }


def compare(predicted: dict[str, Any], measured_: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of predicted against measured, with the relative error."""
    rows = []
    for name, *_ in RATIOS:
        p, m = predicted["ratios"][name], measured_["ratios"][name]
        spread = measured_["per_repeat"][name]
        rows.append(
            {
                "ratio": name,
                "predicted": p,
                "measured": m,
                "rel_err": p / m - 1.0,
                "measured_range": [min(spread), max(spread)],
            }
        )
    for key, what in (("wall_s", "epoch s"), ("data_wait_s", "data wait s")):
        for name in ("standard", "grouped", "gmt", "odb"):
            p, m = predicted[key][name], measured_[key][name]
            rel = p / m - 1.0 if m > 0 else float("nan")
            rows.append({"ratio": f"{name} {what}", "predicted": p, "measured": m, "rel_err": rel})
    p, m = predicted["length_pass_s"], measured_["length_pass_s"]
    rows.append({"ratio": "length pass s", "predicted": p, "measured": m, "rel_err": p / m - 1.0})
    return rows
