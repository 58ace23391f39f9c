"""The discrete-event simulation of one epoch under each batching strategy.

Time advances per rank (DataLoader workers, batcher) and globally (DDP steps and
collectives, which synchronise all ranks). For `odb*` every batching decision is
made by `odb_core.protocol.RankMachine`, one per rank, driven through its
observe / exhaust / form / contribute / all_gather events (`odb_run.py`); the round
semantics are the core's `decide_round`, reached through `RankMachine.all_gather`.
Pad steps, step counts, lost and duplicated ids are read from what the machines
emit. `standard`, `gmt`, `bmt` and the grouped samplers are baselines
(`baselines.py`; they are not the protocol); `odb-ref` drives the PyPI package
`online-dynamic-batching`. The configuration is `sim_config.py`'s `SimConfig`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np

from odb_core.config import Mode
from odb_core.cost_table import CostTable
from odb_core.formers import FormerKind
from simulator.baselines import Baselines
from simulator.epoch_run import Progress
from simulator.odb_run import FORM_S_PER_SAMPLE, OdbRun
from simulator.sim_config import COSTS, DEFAULT_STRATEGIES, STRATEGIES, Faults, SimConfig
from simulator.workloads import Workload

__all__ = [
    "COSTS",
    "DEFAULT_STRATEGIES",
    "FORM_S_PER_SAMPLE",
    "STRATEGIES",
    "Faults",
    "Progress",
    "SimConfig",
    "augmented",
    "ratios",
    "simulate",
    "table_exchange_s",
]


class _Run(Baselines, OdbRun):
    """One strategy's run of one epoch: the baselines and the odb strategies."""


def augmented(workload: Workload, noise: float, rng: np.random.Generator) -> Workload:
    """The workload as the next epoch sees it: every sample's tokens and preprocessing
    time scaled by one log-normal factor (sigma `noise`), as augmentation (random
    crops and resizes, template choices) would; the cached lengths stay as they were."""
    f = np.exp(rng.normal(0.0, noise, workload.n)) if noise > 0 else np.ones(workload.n)
    text = np.maximum(1, np.rint(workload.text * f)).astype(workload.text.dtype)
    visual = np.rint(workload.visual * f).astype(workload.visual.dtype)
    return replace(workload, text=text, visual=visual, prep_s=workload.prep_s * f)


def table_exchange_s(cfg: SimConfig, ids: int) -> float:
    """The epoch close's exchange of the cost table: a ring all-reduce (MAX) of one
    byte per id on the gloo group, the loader's transport."""
    w, net = cfg.ranks, cfg.hardware.network
    if w <= 1:
        return 0.0
    alpha = net.gloo_alpha_internode_s if net.nodes > 1 else net.gloo_alpha_s
    return 2 * (w - 1) * alpha + 2 * (w - 1) / w * ids / net.gloo_beta


def simulate(cfg: SimConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run every selected strategy on the same workload, for `cfg.epochs` epochs;
    returns plain data of the last epoch, with every epoch's in `epochs` when there
    are several."""
    if cfg.epochs == 1:
        return _simulate_epoch(cfg, progress, 0, {})
    tables: dict[str, CostTable | None] = {}
    learned: dict[str, CostTable | None] = {}
    workload, epochs = cfg.workload, []
    out: dict[str, Any] = {}
    for e in range(cfg.epochs):
        if e > 0:
            workload = augmented(workload, cfg.epoch_noise, np.random.default_rng([cfg.seed, 9, e]))
        out = _simulate_epoch(replace(cfg, workload=workload), progress, e, tables)
        epochs.append(
            {
                "epoch": e,
                "priced": {k: v is not None for k, v in out.pop("priced").items()},
                "samples_per_s": {k: m["samples_per_s"] for k, m in out["strategies"].items()},
                "tail_steps": {k: m["tail_steps"] for k, m in out["strategies"].items()},
                "ratios": out["ratios"],
                "ok": out["ok"],
            }
        )
        learned = out.pop("learned")
        tables = learned if cfg.cost_table else {}
    seen = next((t for t in learned.values() if t is not None), None)
    out["epochs"] = epochs
    out["ok"] = all(e["ok"] for e in epochs)
    if seen is not None:
        out["cost_table"] = {
            "ids": len(seen),
            "bytes": len(seen.codes),
            "seen": seen.seen,
            "exchange_s": round(table_exchange_s(cfg, len(seen)), 6),
        }
    return out


def _simulate_epoch(
    cfg: SimConfig,
    progress: Progress | None,
    epoch: int,
    tables: dict[str, CostTable | None],
) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    perf: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    learned: dict[str, CostTable | None] = {}
    for name in cfg.strategies:
        run = _Run(cfg, progress, epoch, tables.get(name))
        t0 = time.perf_counter()
        if name == "odb-ref":
            from simulator import odb_ref

            reason = odb_ref.unavailable(cfg.ranks)
            if reason is not None:
                skipped[name] = reason
                continue
            res = odb_ref.run(run)
        elif name == "standard":
            res = run.standard()
        elif name == "gmt":
            res = run.gmt()
        elif name == "gmt-safe":
            res = run.gmt_safe()
        elif name == "bmt":
            res = run.bmt()
        elif name == "grouped":
            res = run.grouped()
        elif name == "grouped-modality":
            res = run.grouped_modality()
        elif name == "odb":
            res = run.odb(cfg.former, Mode.JOIN)
        elif name == "odb-bfd":
            res = run.odb(FormerKind.BEST_FIT_DECREASING, Mode.JOIN)
        else:
            res = run.odb(cfg.former, Mode.QUOTA)
        elapsed = time.perf_counter() - t0
        learned[name] = run.learned
        m = res["metrics"]
        results[name] = m
        perf[name] = {
            "sim_wall_s": round(elapsed, 3),
            "sample_events": run.events,
            "sample_events_per_min": round(run.events / elapsed * 60) if elapsed > 0 else 0,
        }
    return {
        "config": cfg.describe(),
        "workload": {"name": cfg.workload.name, **cfg.workload.stats()},
        "hardware": cfg.hardware.describe(),
        "strategies": results,
        "skipped": skipped,
        "ratios": ratios(results),
        "perf": perf,
        "ok": all(not r.get("violations") for r in results.values()),
        **({"learned": learned, "priced": dict(tables)} if cfg.epochs > 1 else {}),
    }


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    def rate(name: str) -> float | None:
        m = results.get(name)
        if m is None or m.get("fault") or not m["samples_per_s"]:
            return None
        return float(m["samples_per_s"])

    base, oracle, group = rate("standard"), rate("gmt"), rate("grouped")
    safe = rate("gmt-safe")
    out: dict[str, dict[str, float | None]] = {}
    for name in results:
        r = rate(name)
        out[name] = {
            "vs_standard": round(r / base, 3) if r and base else None,
            "vs_gmt": round(r / oracle, 3) if r and oracle else None,
            "vs_grouped": round(r / group, 3) if r and group else None,
        }
        if "gmt-safe" in results:
            out[name]["vs_gmt_safe"] = round(r / safe, 3) if r and safe else None
    return out
