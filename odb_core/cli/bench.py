"""`odb bench`: real multi-process CPU training, ODBDataLoader vs a plain DataLoader.

W ranks (torch.multiprocessing, gloo, 127.0.0.1) train a trivially cheap DDP model
on the same synthetic dataset, the same workers and the same per-sample
preprocessing cost, taking turns: a plain `DataLoader(batch_size=8)` with a
`DistributedSampler`; ODBDataLoader with max_samples=8 (the same steps and
samples per step, so the ratio is the loader's own cost); and ODBDataLoader with
a padded-token budget equal to the plain loader's largest batch (same peak
memory). Reported: emitted samples/s (medians over repeats, each an epoch after
a warm-up epoch), ratios to plain, the share of training time stalled on the
protocol's all-gather, and collectives per protocol round.

Imports torch only when run, so `odb --help` stays light.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from odb_core.cli.arguments import positive_int
from odb_core.formers import FormerKind

BATCH = 8


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench",
        help="real multi-process CPU training: ODBDataLoader vs DataLoader(batch_size=8)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    _add_loader_options(p)
    m = _add_model_options(p)
    _add_quality_options(p)
    # last in the --model group, yet added after the quality group: its place in usage
    m.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="throughput bars + timeline (PNG); with --quality: held-out loss vs wall time",
    )
    p.set_defaults(run=run)


def _add_loader_options(p: argparse.ArgumentParser) -> None:
    """The options of `odb bench` itself (the ranks, the loader bench's workload)."""
    p.add_argument("--ranks", type=positive_int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument(
        "--samples",
        type=positive_int,
        default=None,
        help="samples per epoch (4000; 400 with --model)",
    )
    p.add_argument("--repeats", type=positive_int, default=3, help="timed epochs per loader")
    p.add_argument(
        "--work-us",
        type=int,
        default=100,
        help="preprocessing CPU time per sample in microseconds (tokenisation stand-in)",
    )
    p.add_argument("--mean-len", type=positive_int, default=64, help="mean sample length")
    p.add_argument(
        "--start-method",
        choices=["fork", "spawn", "forkserver"],
        default="fork",
        help="multiprocessing context of the DataLoader workers",
    )
    p.add_argument(
        "--timeout",
        type=positive_int,
        default=None,
        help="give up after (seconds; 600, 3600 with --model)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_model_options(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The real-model group (`--model`); returned, so `--plot` can join it last."""
    m = p.add_argument_group(
        "real-model training (--model)",
        "train a LlamaForCausalLM built from a config (no download) with DDP, one epoch per "
        "run: standard, grouped (HF group_by_length), gmt, odb-padded, odb-packed and odb-ref "
        "(when installed), interleaved",
    )
    m.add_argument(
        "--model",
        default=None,
        help="llama-tiny, llama-small, llama-100m, or qwen3-vl-tiny (the VLM workload: "
        "images decoded and processed in the DataLoader workers; docs/VLM.md)",
    )
    m.add_argument(
        "--max-len",
        type=positive_int,
        default=None,
        help="longest sample in tokens (1024; 512 with --quality)",
    )
    m.add_argument(
        "--budget",
        type=positive_int,
        default=None,
        help="peak tokens per step and rank (4096; 2048 with --quality)",
    )
    m.add_argument("--eval-samples", type=int, default=64, help="held-out samples (64)")
    m.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help="AdamW learning rate (1e-3): fixed; with --quality the peak of every schedule",
    )
    m.add_argument(
        "--seed",
        type=int,
        default=0,
        help="data and init seed (--quality: init and data order use seed + repeat)",
    )
    m.add_argument(
        "--oversize",
        choices=["error", "solo", "truncate"],
        default="error",
        help="odb-core's policy for a sample over the budget",
    )
    m.add_argument(
        "--buffer-size", type=positive_int, default=None, help="odb-core window (default: its own)"
    )
    m.add_argument(
        "--early-form",
        type=positive_int,
        default=None,
        help="odb-core's early_form: a rank whose window would idle it forms once it holds "
        "this many samples (default: off; static sharding only)",
    )
    m.add_argument(
        "--former",
        choices=[k.value for k in FormerKind],
        default=None,
        help="odb-core's batch former (default: its own, greedy)",
    )
    m.add_argument(
        "--lora",
        action="store_true",
        help="qwen3-vl-tiny: every strategy trains PEFT LoRA adapters (rank 8) on the "
        "language model's attention projections only (needs odb-core[peft])",
    )
    m.add_argument(
        "--strategies",
        default=None,
        help="comma-separated subset to run (default: standard, grouped, gmt, odb-padded, "
        "odb-packed, odb-ref; with --quality every strategy and recipe but odb-ref; "
        "qwen3-vl-tiny: standard, grouped, grouped-estimate, gmt, odb-padded, odb-packed; with "
        "--quality also odb-max-samples, odb-linear-lr); odb-max-samples[-packed]: "
        "odb-padded [odb-packed] at most the fixed batch size a step",
    )
    return m


def _add_quality_options(p: argparse.ArgumentParser) -> None:
    """The time-to-quality group (`--model ... --quality`)."""
    q = p.add_argument_group(
        "time to quality (--model ... --quality)",
        "several epochs per strategy and seed (--repeats seeds, interleaved), held-out loss "
        "every 1/4 epoch (evaluation time excluded), schedules that end on the last update",
    )
    q.add_argument("--quality", action="store_true", help="run the time-to-quality bench")
    q.add_argument("--epochs", type=positive_int, default=None, help="epochs per run (3)")
    q.add_argument(
        "--regime",
        choices=["scratch", "finetune"],
        default="scratch",
        help="finetune: each seed's model is first trained one epoch on another distribution "
        "(the same data under another answer rule; full fine-tuning only, not with --lora)",
    )
    q.add_argument(
        "--pretrain-samples",
        type=positive_int,
        default=None,
        help="samples of the finetune regime's first training (default: --samples)",
    )


def run_model(args: argparse.Namespace) -> int:
    from odb_core.bench import model_bench, model_options, model_output

    if args.workers < 0:
        raise ValueError(f"--workers={args.workers!r} must be >= 0")
    if args.strategies is None:
        default = (
            model_options.QUALITY_DEFAULT if args.quality else model_options.THROUGHPUT_DEFAULT
        )
        if args.model in model_options.VLM_MODELS:
            default = (
                model_options.VLM_QUALITY_DEFAULT if args.quality else model_options.VLM_DEFAULT
            )
        requested = list(default)
    else:
        requested = [s.strip() for s in args.strategies.split(",") if s.strip()]
    params = {
        "model": args.model,
        "ranks": args.ranks,
        "workers": args.workers,
        "samples": args.samples or 400,
        "repeats": args.repeats,
        "max_len": args.max_len or (512 if args.quality else 1024),
        "budget": args.budget or (2048 if args.quality else 4096),
        "eval_samples": args.eval_samples,
        "lr": args.lr,
        "seed": args.seed,
        "oversize": args.oversize,
        "buffer_size": args.buffer_size,
        "former": args.former,
        "early_form": args.early_form,
        "strategies": requested,
        "requested": requested,
        "timeout": args.timeout or 3600,
        "quality": args.quality,
        "epochs": args.epochs or (3 if args.quality else 1),
        "regime": args.regime,
        "pretrain_samples": args.pretrain_samples or args.samples or 400,
        "checkpoints": 4,
        "lora": args.lora,
    }
    result = model_bench.run_bench(params)  # progress lines go to stderr
    if args.plot:
        model_output.plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        for line in model_output.iter_table(result):
            print(line)
    return 0 if result["ok"] else 1


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        return run_model(args)
    args.samples = args.samples or 4000
    args.timeout = args.timeout or 600
    if args.workers < 0:
        raise ValueError(f"--workers={args.workers!r} must be >= 0")
    if args.work_us < 0:
        raise ValueError(f"--work-us={args.work_us!r} must be >= 0")
    result = bench(
        ranks=args.ranks,
        workers=args.workers,
        samples=args.samples,
        repeats=args.repeats,
        work_us=args.work_us,
        mean_len=args.mean_len,
        start_method=args.start_method,
        timeout=args.timeout,
    )
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0 if result["ok"] else 1


def bench(
    *,
    ranks: int = 2,
    workers: int = 1,
    samples: int = 4000,
    repeats: int = 3,
    work_us: int = 100,
    mean_len: int = 64,
    start_method: str = "fork",
    timeout: float = 600,
) -> dict[str, Any]:
    from odb_core.bench import loader_bench
    from odb_core.bench.launch import run_ranks

    params = {
        "ranks": ranks,
        "workers": workers,
        "samples": samples,
        "repeats": repeats,
        "work_us": work_us,
        "mean_len": mean_len,
        "start_method": start_method,
    }
    ran = run_ranks(
        loader_bench.run_rank,
        ranks,
        params,
        timeout=timeout,
        gloo_timeout_s=120,
        prefix="odb-bench-",
    )
    if not ran.ok:
        raise RuntimeError(f"bench ranks failed or timed out (exit codes {ran.exit_codes})")
    result: dict[str, Any] = ran.result
    result["params"] = params
    return result


def print_table(r: dict[str, Any]) -> None:
    p, plain, odb, mem = r["params"], r["plain"], r["odb"], r["odb_memory"]
    print(
        f"odb bench: {p['ranks']} gloo ranks, {p['workers']} workers/rank "
        f"({p['start_method']}), {p['samples']} samples/epoch, {p['work_us']} us "
        f"preprocessing/sample, {p['repeats']} timed epochs each (medians)"
    )
    print(f"{'loader':34} {'samples/s':>10} {'steps':>6} {'samples/step (all ranks)':>25}")
    rows = (
        ("DataLoader(batch_size=8)", plain),
        ("ODBDataLoader(max_samples=8)", odb),
        ("ODBDataLoader(equal peak memory)", mem),
    )
    for name, row in rows:
        print(
            f"{name:34} {row['samples_per_s']:>10.0f} {row['steps']:>6} "
            f"{row['samples_per_step']:>25.2f}"
        )
    print(
        f"throughput ratio ODB / plain: {r['ratio']:.3f} at 8 samples/step (target >= 0.95), "
        f"{r['ratio_memory']:.3f} at equal peak memory"
    )
    print(f"one all-gather on the loader's gloo group: {r['allgather_latency_us']:.0f} us")
    for name, row in (("max_samples=8", odb), ("equal memory", mem)):
        print(
            f"  {name}: {row['collectives_per_round']:.2f} all-gathers per round (target <= 1)"
            f", {row['rounds']} rounds = {row['collective_pct']:.2f}% of training time even "
            f"unoverlapped (target <= 2%); {row['pad_steps']} pad steps; the loop waited "
            f"{row['stall_pct']:.1f}% for batches, {row['collective_stall_pct']:.1f}% while "
            "the protocol thread was in an all-gather (peers still filling, GIL hand-offs)"
        )
    print(f"aligned steps, exactly-once ids, identical global metadata: {r['ok']}")


def demo_section() -> bool:
    """A short bench for `odb demo` (< 40 s on two cores)."""
    print("== ODBDataLoader vs DataLoader: real 2-rank gloo CPU training ==")
    start = time.perf_counter()
    try:
        result = bench(ranks=2, workers=1, samples=1200, repeats=1, work_us=100, timeout=120)
    except (RuntimeError, OSError) as exc:
        print(f"bench failed: {exc}")
        return False
    result["params"]["repeats"] = 1
    print_table(result)
    print(f"(bench section took {time.perf_counter() - start:.1f}s)")
    return bool(result["ok"])
