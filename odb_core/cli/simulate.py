"""`odb simulate`: discrete-event simulation of batching strategies over the DGAP core."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

from odb_core.cli.arguments import (
    add_json_flag,
    add_progress_flag,
    nonneg_float,
    positive_float,
    positive_int,
    positive_int_list,
    progress_bar,
    str_list,
    subcommand,
    wants_progress,
)
from odb_core.config import OversizePolicy, Sharding, default_buffer_size
from odb_core.errors import ConfigError
from odb_core.formers import FormerKind

_WORKLOADS = ("ultrachat", "llava", "sharegpt4o", "mmmix")
_DEFAULT_STRATEGIES = (
    "standard",
    "gmt",
    "bmt",
    "grouped",
    "grouped-modality",
    "odb",
    "odb-bfd",
    "odb-quota",
    "odb-ref",
)
_STRATEGIES = (*_DEFAULT_STRATEGIES, "gmt-safe")  # gmt-safe only when named


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subcommand(
        sub,
        "simulate",
        run,
        help="simulate an epoch of W ranks under each batching strategy",
        description=(
            "Discrete-event simulation of one epoch: DataLoader workers, the batcher, the "
            "round collective and a DDP step-time model. odb strategies are decided by "
            "odb_core RankMachines; standard, gmt and bmt are baselines. Every hardware "
            "parameter can be set with --hw KEY=VALUE (see docs/SIMULATOR.md)."
        ),
    )
    _add_run_options(p)
    _add_batching_options(p)
    _add_epoch_options(p)
    _add_pipeline_options(p)
    _add_fault_options(p)
    p.add_argument("--tail-window", type=positive_int, default=12, help="steps in the plotted tail")
    p.add_argument("--markdown", action="store_true", help="print one markdown table of all runs")
    add_json_flag(p)
    p.add_argument("--plot", default=None, metavar="OUT.png")
    add_progress_flag(p)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """What is simulated: the workloads, the world sizes and the strategies."""
    p.add_argument(
        "--workload",
        default="ultrachat",
        help=f"{', '.join(_WORKLOADS)}, 'all', a FILE.jsonl, or a comma-separated list",
    )
    p.add_argument("--samples", type=positive_int, default=20_000, help="samples per epoch")
    p.add_argument(
        "--ranks", type=positive_int_list, default=[8], help="world size W, or a list such as 8,16"
    )
    p.add_argument(
        "--nodes",
        type=positive_int,
        default=None,
        help="nodes (default: ceil(ranks / gpus-per-node)); >1 adds inter-node latency",
    )
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument(
        "--strategies",
        type=str_list,
        default=list(_DEFAULT_STRATEGIES),
        help=f"comma-separated subset of {','.join(_STRATEGIES)}",
    )
    p.add_argument("--seed", type=int, default=0)


def _add_batching_options(p: argparse.ArgumentParser) -> None:
    """The budget, the cost model and odb's window, former and early forms."""
    p.add_argument(
        "--budget", type=positive_int, default=None, help="token budget (default: memory model)"
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="standard's per-rank batch size (default: largest that cannot OOM)",
    )
    p.add_argument("--cost", choices=["packed", "padded", "attention"], default="packed")
    p.add_argument("--attention-alpha", type=positive_float, default=1.0 / 4096)
    p.add_argument(
        "--buffer",
        type=positive_int,
        default=None,
        help="odb window K per rank (default: the loader's, 1,024 with --cost padded, else 64)",
    )
    p.add_argument(
        "--former",
        choices=[k.value for k in FormerKind],
        default=FormerKind.SORT_WINDOW_GREEDY.value,
        help="odb and odb-quota's batch former (default: the loader's, greedy)",
    )
    p.add_argument(
        "--early-form",
        type=positive_int,
        default=None,
        metavar="K0",
        help="odb: a rank with nothing ready forms its partial window (at least K0 "
        "samples) early, emitting only its fullest batch, when waiting for the rest "
        "would idle it longer than --early-form-wait (default: off)",
    )
    p.add_argument(
        "--early-form-wait",
        type=nonneg_float,
        default=0.25,
        metavar="S",
        help="seconds of expected preprocessing for the rest of the window above "
        "which a rank forms early (default 0.25)",
    )
    p.add_argument("--max-steps-per-round", type=positive_int, default=8)
    p.add_argument(
        "--sharding",
        choices=[k.value for k in Sharding],
        default=None,
        help="odb's sharding: ids dealt each round to the ranks holding the least work "
        "(dynamic, the default, as the loader's) or a fixed 1/W shard per rank (static; "
        "the default with --early-form, which is static-only, and --cost padded)",
    )


def _add_epoch_options(p: argparse.ArgumentParser) -> None:
    """Epochs in a row (the learned cost table), the quota and the oversize policy."""
    p.add_argument(
        "--epochs",
        type=positive_int,
        default=1,
        help="epochs in a row; from the second on, odb's deals are priced by the costs "
        "observed in the one before (the learned cost table), and each sample's cost "
        "varies between epochs by --epoch-noise (default 1)",
    )
    p.add_argument(
        "--epoch-noise",
        type=nonneg_float,
        default=0.1,
        metavar="SIGMA",
        help="relative spread (log-normal sigma) of a sample's cost from one epoch to the "
        "next, as augmentation makes it (default 0.1)",
    )
    p.add_argument(
        "--no-cost-table",
        action="store_true",
        help="with --epochs: price every epoch's deals at the mean, as the first (the "
        "control of the learned table's gain)",
    )
    p.add_argument("--quota", type=positive_int, default=None, help="odb-quota global quota")
    p.add_argument(
        "--oversize",
        choices=[m.value for m in OversizePolicy],
        default="solo",
        help="policy for one sample over the budget (default solo)",
    )


def _add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """The DataLoader, bmt's buckets, the cached lengths and the hardware."""
    p.add_argument("--workers", type=positive_int, default=4, help="DataLoader workers per rank")
    p.add_argument("--prefetch-factor", type=positive_int, default=2)
    p.add_argument("--bmt-bucket", type=positive_int, default=4096, help="bmt mega-bucket size")
    p.add_argument(
        "--length-noise",
        type=nonneg_float,
        default=None,
        help="relative noise of cached vs observed length (default per workload)",
    )
    p.add_argument("--gpu", choices=["h100", "h20"], default="h100")
    p.add_argument(
        "--hw",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a hardware/model/network parameter, e.g. --hw mfu=0.35",
    )


def _add_fault_options(p: argparse.ArgumentParser) -> None:
    """Stragglers, stalled workers, slow collectives, a dead rank (see `_faults`)."""
    p.add_argument("--straggler", action="append", default=[], metavar="RANK:FACTOR")
    p.add_argument("--stall", action="append", default=[], metavar="RANK:WORKER:AT_S:DUR_S")
    p.add_argument("--slow-collectives", default=None, metavar="PROB:FACTOR")
    p.add_argument("--kill-rank", default=None, metavar="RANK:AT_S")
    p.add_argument("--peer-timeout", type=positive_float, default=60.0)


def _parts(text: str, n: int, what: str) -> list[str]:
    parts = text.split(":")
    if len(parts) != n:
        raise ConfigError(f"{what} {text!r} must have {n} ':'-separated fields")
    return parts


def _num(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ConfigError(f"{what} {text!r} is not a number") from None
    if not math.isfinite(v):
        raise ConfigError(f"{what} {text!r} must be finite")
    return v


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{what} {text!r} is not an integer") from None


def _hw_overrides(items: list[str]) -> dict[str, float | bool]:
    out: dict[str, float | bool] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--hw {item!r} must be KEY=VALUE")
        key = key.strip().replace("-", "_")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        else:
            out[key] = _num(value, f"--hw {key}")
    return out


def _workloads(text: str) -> list[str]:
    names = list(_WORKLOADS) if text == "all" else str_list(text)
    if not names:
        raise ConfigError(f"--workload {text!r} names no workload")
    for n in names:
        if n not in _WORKLOADS and not n.endswith(".jsonl"):
            raise ConfigError(
                f"unknown workload {n!r}; expected one of {', '.join(_WORKLOADS)}, "
                "'all' or a FILE.jsonl"
            )
    return names


def _faults(args: argparse.Namespace) -> Any:
    from simulator.engine import Faults

    stragglers = []
    for s in args.straggler:
        r, f = _parts(s, 2, "--straggler")
        stragglers.append((_int(r, "straggler rank"), _num(f, "straggler factor")))
    stalls = []
    for s in args.stall:
        r, w, at, dur = _parts(s, 4, "--stall")
        stalls.append(
            (
                _int(r, "stall rank"),
                _int(w, "stall worker"),
                _num(at, "stall time"),
                _num(dur, "stall duration"),
            )
        )
    prob, factor = 0.0, 10.0
    if args.slow_collectives:
        p, f = _parts(args.slow_collectives, 2, "--slow-collectives")
        prob, factor = _num(p, "slow collective probability"), _num(f, "slow collective factor")
    dead, at_s = None, 0.0
    if args.kill_rank:
        r, t = _parts(args.kill_rank, 2, "--kill-rank")
        dead, at_s = _int(r, "kill rank"), _num(t, "kill time")
    return Faults(tuple(stragglers), tuple(stalls), prob, factor, dead, at_s)


def build_configs(args: argparse.Namespace) -> list[Any]:
    """One SimConfig per (workload, ranks); raises ConfigError naming a bad value."""
    from simulator.engine import SimConfig
    from simulator.hardware import make_hardware
    from simulator.workloads import make_workload

    unknown = [s for s in args.strategies if s not in _STRATEGIES]
    if unknown:
        raise ConfigError(
            f"unknown strategy {unknown[0]!r}; expected one of {', '.join(_STRATEGIES)}"
        )
    overrides = _hw_overrides(args.hw)
    faults = _faults(args)
    configs = []
    for name in _workloads(args.workload):
        workload = make_workload(name, args.samples, args.seed, args.length_noise)
        for ranks in args.ranks:
            nodes = args.nodes or max(1, math.ceil(ranks / args.gpus_per_node))
            configs.append(
                SimConfig(
                    workload=workload,
                    ranks=ranks,
                    hardware=make_hardware(args.gpu, nodes, overrides),
                    strategies=tuple(args.strategies),
                    seed=args.seed,
                    budget=args.budget,
                    batch_size=args.batch_size,
                    cost=args.cost,
                    attention_alpha=args.attention_alpha,
                    buffer_size=args.buffer or default_buffer_size(args.cost),
                    former=FormerKind(args.former),
                    max_steps_per_round=args.max_steps_per_round,
                    quota=args.quota,
                    oversize=OversizePolicy(args.oversize),
                    num_workers=args.workers,
                    prefetch_factor=args.prefetch_factor,
                    bmt_bucket=args.bmt_bucket,
                    peer_timeout_s=args.peer_timeout,
                    faults=faults,
                    tail_window=args.tail_window,
                    sharding=None if args.sharding is None else Sharding(args.sharding),
                    early_form=args.early_form,
                    early_form_wait_s=args.early_form_wait,
                    epochs=args.epochs,
                    epoch_noise=args.epoch_noise,
                    cost_table=not args.no_cost_table,
                )
            )
    return configs


def run(args: argparse.Namespace) -> int:
    from simulator.engine import simulate
    from simulator.tables import format_run, format_summary, markdown_table, plot

    configs = build_configs(args)
    start = time.perf_counter()
    show = wants_progress(args)
    runs = []
    for cfg in configs:
        bar = _progress_bar(cfg, show)
        try:
            runs.append(simulate(cfg, progress=bar.update if bar is not None else None))
        finally:
            if bar is not None:
                bar.close()
    if args.plot:
        plot(runs, args.plot)
    ok = all(r["ok"] for r in runs)
    if args.json:
        out: dict[str, Any] = runs[0] if len(runs) == 1 else {"runs": runs, "ok": ok}
        if args.plot:
            out = {**out, "plot": args.plot}
        print(json.dumps(out))
    elif args.markdown:
        print(markdown_table(runs))
    else:
        for r in runs:
            print(format_run(r))
            print()
        if len(runs) > 1:
            print(format_summary(runs))
        if args.plot:
            print(f"plot written to {args.plot}")
        print(f"simulated {len(runs)} run(s) in {time.perf_counter() - start:.1f}s")
    return 0 if ok else 1


def _progress_bar(cfg: Any, show: bool) -> Any:
    if not show:
        return None
    total = cfg.workload.n * len(cfg.strategies)
    return progress_bar(total=total, desc=f"{cfg.workload.name} W={cfg.ranks}", unit="sample")


def demo_section() -> bool:
    """A short simulation for `odb demo` (a few seconds): sharegpt4o on 8 ranks."""
    from simulator.engine import SimConfig, simulate
    from simulator.hardware import make_hardware
    from simulator.tables import format_run
    from simulator.workloads import make_workload

    print("== Simulated epoch: sharegpt4o, 8 ranks, 4,000 samples (docs/SIMULATOR.md) ==")
    cfg = SimConfig(
        workload=make_workload("sharegpt4o", 4000, 0),
        ranks=8,
        hardware=make_hardware("h100", 1),
        strategies=("standard", "gmt", "bmt", "odb", "odb-bfd", "odb-quota"),
    )
    out = simulate(cfg)
    print(format_run(out))
    odb = out["strategies"]["odb"]
    return bool(out["ok"]) and odb["lost_ids"] == 0 and odb["duplicated_ids"] == 0
