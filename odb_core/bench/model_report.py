"""The result of `odb bench --model` from its ranks' runs (pure): each run's check
(equal steps on every rank, every id exactly once) and summary over the ranks,
and the report: medians over the repeats, the paired throughput ratios, ok."""

from __future__ import annotations

import statistics
from typing import Any

from odb_core.bench.model_options import ODB_STRATEGIES
from odb_core.bench.recipes import RECIPES


def coverage(
    name: str, rep: int, per_rank: list[dict[str, Any]], epochs: int, n: int
) -> tuple[bool, bool, list[str]]:
    """Whether every epoch of a run had equal steps on every rank, and every id
    exactly once; an odb-core run's failures, named."""
    errors: list[str] = []
    equal_steps = all(len({r["epoch_steps"][e] for r in per_rank}) == 1 for e in range(epochs))
    exactly_once = True
    for e in range(epochs):
        ids = sorted(i for r in per_rank for i in r["ids"][e])
        once = ids == list(range(n))
        exactly_once = exactly_once and once
        if name in RECIPES and (not equal_steps or not once):
            dup = len(ids) - len(set(ids))
            lost = n - len(set(ids))
            errors.append(
                f"{name} repeat {rep} epoch {e}: steps per rank "
                f"{[r['epoch_steps'][e] for r in per_rank]}, {dup} duplicated and "
                f"{lost} lost ids"
            )
    return equal_steps, exactly_once, errors


def summarise(
    per_rank: list[dict[str, Any]], precompute: float, eval_loss: float, n: int
) -> dict[str, Any]:
    wall = max(r["wall"] for r in per_rank)
    samples = sum(r["samples"] for r in per_rank)
    real = sum(r["real_tokens"] for r in per_rank)
    computed = sum(r["computed_tokens"] for r in per_rank)
    return {
        "wall_s": wall,
        "precompute_s": precompute,
        "samples": samples,
        "samples_per_s": samples / wall,
        "samples_per_s_incl_precompute": samples / (wall + precompute),
        "tokens_per_s": real / wall,
        "padding": 1.0 - real / max(1, computed),
        "steps_per_rank": [r["steps"] for r in per_rank],
        "updates": per_rank[0]["updates"],
        "pad_steps": sum(r["pads"] for r in per_rank),
        "peak_rss_mb": max(r["rss"] for r in per_rank),
        "peak_rss_mb_per_rank": [r["rss"] for r in per_rank],
        "dev_shm_peak_mb": max(r["shm"] for r in per_rank),
        "data_wait_s": max(r["wait"] for r in per_rank),
        "collate_s": max(r["collate"] for r in per_rank),
        "vision_forward_s": max(r["vision"] for r in per_rank),
        "allgather_stall_s": max(r["allgather"] for r in per_rank),
        "train_loss_per_token": sum(r["loss_sum"] for r in per_rank)
        / max(1, sum(r["loss_tokens"] for r in per_rank)),
        "held_out_loss": eval_loss,
        "unique_ids": len({i for r in per_rank for i in r["ids"][-1]}),  # last epoch
        "dataset": n,
    }


MEDIAN_KEYS = (
    "wall_s",
    "precompute_s",
    "samples_per_s",
    "samples_per_s_incl_precompute",
    "tokens_per_s",
    "padding",
    "pad_steps",
    "peak_rss_mb",
    "dev_shm_peak_mb",
    "data_wait_s",
    "collate_s",
    "vision_forward_s",
    "allgather_stall_s",
    "train_loss_per_token",
    "held_out_loss",
)


def _paired(runs: dict[str, list[dict[str, Any]]], a: str, b: str, key_b: str) -> float | None:
    if a not in runs or b not in runs:
        return None
    ratios = [x["samples_per_s"] / y[key_b] for x, y in zip(runs[a], runs[b], strict=True)]
    return float(statistics.median(ratios))


def report(
    params: dict[str, Any],
    runs: dict[str, list[dict[str, Any]]],
    timelines: dict[str, Any],
    fixed_batch: int,
) -> dict[str, Any]:
    strategies: dict[str, Any] = {}
    for name, rs in runs.items():
        row: dict[str, Any] = {k: float(statistics.median(r[k] for r in rs)) for k in MEDIAN_KEYS}
        row["steps_per_rank"] = rs[-1]["steps_per_rank"]
        row["equal_steps"] = all(r["equal_steps"] for r in rs)
        row["exactly_once"] = all(r["exactly_once"] for r in rs)
        row["runs"] = rs
        if "loader" in rs[-1]:
            row["loader"] = rs[-1]["loader"]  # odb-core's options in force (describe())
        strategies[name] = row
    ratios: dict[str, float | None] = {
        "grouped/standard": _paired(runs, "grouped", "standard", "samples_per_s")
    }
    for odb in ODB_STRATEGIES:
        ratios[f"{odb}/standard"] = _paired(runs, odb, "standard", "samples_per_s")
        ratios[f"{odb}/grouped"] = _paired(runs, odb, "grouped", "samples_per_s")
        ratios[f"{odb}/grouped_incl_length_pass"] = _paired(
            runs, odb, "grouped", "samples_per_s_incl_precompute"
        )
        ratios[f"{odb}/grouped-estimate"] = _paired(runs, odb, "grouped-estimate", "samples_per_s")
        ratios[f"{odb}/gmt"] = _paired(runs, odb, "gmt", "samples_per_s")
        ratios[f"{odb}/gmt_incl_precompute"] = _paired(
            runs, odb, "gmt", "samples_per_s_incl_precompute"
        )
        ratios[f"{odb}/odb-ref"] = _paired(runs, odb, "odb-ref", "samples_per_s")
        ratios[f"{odb}/trl-packed"] = _paired(runs, odb, "trl-packed", "samples_per_s")
        ratios[f"{odb}/trl-packed_incl_pass"] = _paired(
            runs, odb, "trl-packed", "samples_per_s_incl_precompute"
        )
    if "standard" in strategies:
        base = strategies["standard"]["held_out_loss"]
        for row in strategies.values():
            row["held_out_vs_standard"] = row["held_out_loss"] / base - 1.0
    ok = all(
        strategies[s]["equal_steps"] and strategies[s]["exactly_once"]
        for s in ODB_STRATEGIES
        if s in strategies
    )
    return {
        "ok": ok,
        "params": {**params, "fixed_batch": fixed_batch},
        "strategies": strategies,
        "ratios": {k: v for k, v in ratios.items() if v is not None},
        "timeline_rank0_last_repeat": timelines,
        "timeline_fields": [
            "t_s",
            "wait_s",
            "compute_s",
            "real_tokens",
            "computed_tokens",
            "samples",
            "is_pad",
        ],
        "notes": [],
    }
