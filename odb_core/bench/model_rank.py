"""A rank of `odb bench --model`: every repeat of every strategy, interleaved, each
run gathered from every rank, checked (an odb-core run that lost, duplicated or
misaligned a step raises), summarised and reported by rank 0."""

from __future__ import annotations

import sys
from typing import Any

from odb_core.bench.model_options import WARMUP
from odb_core.bench.model_report import coverage, report, summarise
from odb_core.bench.model_setup import RankSetup
from odb_core.bench.model_train import RunStats, train


def run_rank(rank: int, world: int, params: dict[str, Any], progress: bool) -> dict[str, Any]:
    """The rank's share of the bench; rank 0's return value is the result."""
    rs = RankSetup(rank, world, params)
    strategies = rs.strategies
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in strategies}
    curves: dict[str, list[Any]] = {s: [] for s in strategies}
    timelines: dict[str, Any] = {}
    rank_steps: dict[str, Any] = {s: [] for s in strategies}  # per repeat: ranks, steps
    rs.init_states = [rs.init_for(rep) for rep in range(params["repeats"])]
    for rep in range(params["repeats"]):
        for name in strategies:
            run, wall, precompute, allgather, curve = train(rs, name, rep)
            eval_loss = curve[-1][2] if curve else rs.held_out_loss()
            per_rank = _gather(run, wall, allgather, world)
            equal_steps, exactly_once, errors = coverage(name, rep, per_rank, rs.epochs, len(rs.ds))
            summary = summarise(per_rank, precompute, eval_loss, len(rs.ds))
            summary["equal_steps"] = equal_steps
            summary["exactly_once"] = exactly_once
            if run.loader is not None:
                summary["loader"] = run.loader
            if rs.quality:
                summary["curve"] = curve
            runs[name].append(summary)
            rank_steps[name].append(
                [{"timeline": r["timeline"], "ids": r["step_ids"]} for r in per_rank]
            )
            curves[name].append(curve)
            if rep == params["repeats"] - 1:
                timelines[name] = run.timeline if rank == 0 else None
            if rank == 0 and progress:
                _print_progress(rep, params["repeats"], name, summary, per_rank, eval_loss)
            if errors:
                raise RuntimeError("; ".join(errors))
    model = rs.model
    counts = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    result = report({**params, **counts}, runs, timelines, rs.fixed_batch)
    result["timeline_ranks"] = rank_steps
    if rs.quality:
        from odb_core.bench.quality import summarise as quality_summary

        result["quality"] = {
            "regime": params.get("regime", "scratch"),
            "epochs": rs.epochs,
            "checkpoints_per_epoch": rs.per_epoch_checks,
            "schedule": f"linear to 0 at the last update, warmup {WARMUP:g} of the run",
            "strategies": quality_summary(curves, "standard", "grouped"),
        }
    return result


def _gather(run: RunStats, wall: float, allgather: float, world: int) -> list[dict[str, Any]]:
    """Every rank's run (an all-gather)."""
    import torch.distributed as dist

    mine = {
        "steps": run.steps,
        "updates": run.updates,
        "pads": run.pads,
        "samples": run.samples,
        "real_tokens": run.real_tokens,
        "computed_tokens": run.computed_tokens,
        "loss_sum": run.loss_sum,
        "loss_tokens": run.loss_tokens,
        "wait": run.wait,
        "collate": run.collate,
        "vision": run.vision,
        "allgather": allgather,
        "wall": wall,
        "rss": run.peak_rss,
        "shm": run.peak_shm,
        "ids": run.epoch_ids,
        "epoch_steps": run.epoch_steps,
        "timeline": run.timeline,
        "step_ids": run.step_ids,
    }
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, mine)
    return per_rank


def _print_progress(
    rep: int,
    repeats: int,
    name: str,
    summary: dict[str, Any],
    per_rank: list[dict[str, Any]],
    eval_loss: float,
) -> None:
    steps = [r["steps"] for r in per_rank]
    print(
        f"[odb bench] repeat {rep + 1}/{repeats} {name:13} "
        f"{summary['wall_s']:7.1f} s  {summary['samples_per_s']:7.2f} samples/s  "
        f"steps/rank {steps}  padding {100 * summary['padding']:.1f}%  "
        f"held-out loss {eval_loss:.4f}",
        file=sys.stderr,
        flush=True,
    )
