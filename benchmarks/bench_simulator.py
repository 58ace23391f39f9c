"""Simulator performance and the simulated strategy ratios (`make bench`).

Targets from issue 4 (reported, never asserted on timing):
- >= 1M simulated sample events per minute on one core;
- W = 1,024 ranks over 100k samples in under 2 minutes;
- `odb fuzz --ranks 64 --schedules 500` in reasonable time;
- odb/standard, odb/gmt and odb/grouped ratios per workload on 8 ranks (1 node) and
  16 ranks (2 nodes).
Numbers go to `extra_info` (see `--benchmark-json`) and are printed.
"""

from __future__ import annotations

from typing import Any

import pytest

from simulator.engine import DEFAULT_STRATEGIES, SimConfig, simulate
from simulator.fuzz import fuzz
from simulator.hardware import make_hardware
from simulator.workloads import make_workload

ALL_BUT_REF = tuple(s for s in DEFAULT_STRATEGIES if s != "odb-ref")


def _median(benchmark: Any) -> float | None:
    stats = getattr(benchmark, "stats", None)
    return None if stats is None else float(stats.stats.median)


def test_sample_events_per_minute(benchmark: Any) -> None:
    cfg = SimConfig(make_workload("ultrachat", 100_000, 0), 8, make_hardware(), ("odb",))
    out = benchmark.pedantic(simulate, args=(cfg,), rounds=3, iterations=1)
    events = out["perf"]["odb"]["sample_events"]
    median = _median(benchmark) or out["perf"]["odb"]["sim_wall_s"]
    benchmark.extra_info["sample_events"] = events
    benchmark.extra_info["sample_events_per_min"] = round(events / median * 60)
    print(f"\nodb, W=8, 100k samples: {events / median * 60:,.0f} sample events/min")
    assert out["strategies"]["odb"]["lost_ids"] == 0


def test_world_1024_over_100k_samples(benchmark: Any) -> None:
    cfg = SimConfig(make_workload("ultrachat", 100_000, 0), 1024, make_hardware(), ALL_BUT_REF)
    out = benchmark.pedantic(simulate, args=(cfg,), rounds=1, iterations=1)
    total = sum(p["sim_wall_s"] for p in out["perf"].values())
    benchmark.extra_info["strategies"] = list(out["strategies"])
    benchmark.extra_info["per_strategy_s"] = {k: v["sim_wall_s"] for k, v in out["perf"].items()}
    print(f"\nW=1024, 100k samples, {len(out['strategies'])} strategies: {total:.1f}s")
    assert out["ok"]


def test_fuzz_64_ranks_500_schedules(benchmark: Any) -> None:
    report = benchmark.pedantic(fuzz, args=(64, 500, 0), rounds=1, iterations=1)
    out = report.to_json()
    benchmark.extra_info["violations"] = out["violations"]
    benchmark.extra_info["worst"] = {
        k: (v["value"], v["bound"]) for k, v in out["worst"].items() if v is not None
    }
    print(f"\nfuzz 64 x 500: {out['schedules']} schedules, {out['violations']} violations")
    assert out["ok"]


@pytest.mark.parametrize("ranks", [8, 16])
@pytest.mark.parametrize("workload", ["ultrachat", "llava", "sharegpt4o", "mmmix"])
def test_strategy_ratios(benchmark: Any, workload: str, ranks: int) -> None:
    hw = make_hardware("h100", nodes=ranks // 8)
    cfg = SimConfig(make_workload(workload, 20_000, 0), ranks, hw, ALL_BUT_REF)
    out = benchmark.pedantic(simulate, args=(cfg,), rounds=1, iterations=1)
    r = out["ratios"]
    info = {
        "odb_vs_standard": r["odb"]["vs_standard"],
        "odb_vs_gmt": r["odb"]["vs_gmt"],
        "odb_vs_grouped": r["odb"]["vs_grouped"],
        "odb_bfd_vs_standard": r["odb-bfd"]["vs_standard"],
        "odb_bfd_vs_gmt": r["odb-bfd"]["vs_gmt"],
        "odb_fill": out["strategies"]["odb"]["budget_fill"],
        "odb_bfd_fill": out["strategies"]["odb-bfd"]["budget_fill"],
        "gmt_oom_steps": out["strategies"]["gmt"]["oom_steps"],
    }
    benchmark.extra_info.update(info)
    print(f"\n{workload} W={ranks}: {info}")
    assert out["strategies"]["odb"]["lost_ids"] == 0
