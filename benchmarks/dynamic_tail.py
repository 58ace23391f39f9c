"""The tail of a skewed epoch in steps and in seconds, static vs dynamic sharding,
on real torchrun gloo ranks (issue 19, "Measure it").

The dataset is tests/test_torch_dynamic.py's `Skewed`: every 4th sample is long
(48 tokens, the others 4; token budget 64), so round-robin static shards give
rank 0 every long sample. Each step runs a small MLP forward/backward over the
batch's tokens (work proportional to tokens; none on a pad step, as a pad's
loss weight is 0 and on one accelerator per rank it would not slow the others)
and all-reduces the gradients, as DDP does, so the ranks are step-coupled.
One `torchrun --standalone --nproc-per-node R` per (sharding, repeat), static
and dynamic interleaved. Per run: epoch steps, tail steps (steps after the
first rank ran its last real batch), tail seconds (from the end of that batch
to the epoch's end on the last rank), epoch seconds, real batches per rank;
each run is checked for 0 lost / 0 duplicated ids and equal steps. Each run
trains `--epochs` epochs (2 by default) in one launch; from the second on,
dynamic sharding prices its deals by the cost table the ranks learned and
exchanged at the previous epoch's close (issue 32), and the figures are given
per epoch.

    .venv/bin/python benchmarks/dynamic_tail.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

LONG, SHORT = 48, 4  # tokens; the budget (64) holds one long sample
SHARDINGS = ("static", "dynamic")


def length_of(i: int) -> int:
    return LONG if i % 4 == 0 else SHORT


# --------------------------------------------------------------------- the rank


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import Dataset

    from odb_core import ODBDataLoader
    from odb_core.torch.elastic import init_process_group
    from odb_core.torch.meta import pop_step_meta

    class Skewed(Dataset[dict[str, Any]]):
        """Every 4th sample is long: round-robin static shards give them to rank 0."""

        def __len__(self) -> int:
            return int(a.samples)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": torch.full((length_of(i),), i % 100)}

    def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
        # packed, as the budget's cost model (packed tokens) assumes: no padding work
        return {"input_ids": torch.cat([s["input_ids"] for s in samples])}

    torch.set_num_threads(1)
    torch.manual_seed(0)
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    w = a.width
    model = torch.nn.Sequential(
        torch.nn.Embedding(100, w), torch.nn.Linear(w, 4 * w), torch.nn.ReLU(),
        torch.nn.Linear(4 * w, w),
    )  # fmt: skip
    params = list(model.parameters())
    loader = ODBDataLoader(
        Skewed(),
        collate_fn=collate,
        token_budget=64,
        buffer_size=8,
        max_steps_per_round=4,
        peer_timeout=60,
        sharding=a.sharding,
    )
    epochs = []
    for epoch in range(a.epochs):
        loader.set_epoch(epoch)
        rows = []
        dist.barrier()
        t0 = time.time()
        for batch in loader:
            t_in = time.time()
            meta = pop_step_meta(batch)
            info = loader.step_info
            assert info is not None and info.step == meta.step and info.is_pad == meta.is_pad
            x = batch["input_ids"]
            if not meta.is_pad:
                loss = model(x).square().mean() * meta.loss_scale
                loss.backward()
            flat = torch.cat(
                [
                    torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1)
                    for p in params
                ]
            )
            dist.all_reduce(flat)
            for p in params:
                p.grad = None
            rows.append(
                {
                    "step": meta.step,
                    "pad": meta.is_pad,
                    "ids": [] if meta.is_pad else list(info.sample_ids),
                    "tokens": 0 if meta.is_pad else int(x.numel()),
                    "t_in": t_in,
                    "t_end": time.time(),
                }
            )
        t_done = time.time()
        table = loader.cost_table  # what the next epoch's deals are priced by
        epochs.append(
            {
                "t0": t0,
                "t_done": t_done,
                "rows": rows,
                "table_seen_after": None if table is None else table.seen,
            }
        )
    Path(a.out, f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "world": world, "epochs": epochs})
    )
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ the launcher


class RunFailed(AssertionError):
    pass


def facts(out: Path, ranks: int, samples: int) -> list[dict[str, Any]]:
    """One run's numbers, per epoch, from its ranks' logs; RunFailed on lost or
    duplicated ids or unequal steps in any epoch."""
    logs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    per_epoch = []
    for e in range(len(logs[0]["epochs"])):
        epoch = [{"rank": x["rank"], **x["epochs"][e]} for x in logs]
        try:
            facts_e = {"epoch": e, **epoch_facts(epoch, samples)}
        except RunFailed as exc:
            raise RunFailed(f"epoch {e}: {exc}") from None
        # the ids the learned table priced this epoch's deals by: what the ranks
        # observed in the epoch before (0: priced at the mean)
        facts_e["priced_ids"] = (logs[0]["epochs"][e - 1]["table_seen_after"] or 0) if e else 0
        per_epoch.append(facts_e)
    return per_epoch


def epoch_facts(logs: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    ranks = len(logs)
    steps = {r: len(x["rows"]) for r, x in enumerate(logs)}
    if len(set(steps.values())) != 1:
        raise RunFailed(f"unequal steps per rank: {steps}")
    for x in logs:
        if [row["step"] for row in x["rows"]] != list(range(len(x["rows"]))):
            raise RunFailed(f"rank {x['rank']}: steps not 0..n-1")
    seen = Counter(i for x in logs for row in x["rows"] for i in row["ids"])
    lost = sorted(set(range(samples)) - set(seen))
    dup = sorted(i for i, n in seen.items() if n != 1)
    if lost or dup or set(seen) - set(range(samples)):
        raise RunFailed(f"lost ids {lost[:10]} ({len(lost)}), duplicated {dup[:10]} ({len(dup)})")
    n = steps[0]
    last_real = [
        max((k for k, row in enumerate(x["rows"]) if not row["pad"]), default=-1) for x in logs
    ]
    first_rank = min(range(ranks), key=lambda r: last_real[r])
    first = last_real[first_rank]
    end = max(x["t_done"] for x in logs)
    start = min(x["t0"] for x in logs)
    tail_from = logs[first_rank]["rows"][first]["t_end"] if first >= 0 else start
    return {
        "epoch_steps": n,
        "tail_steps": n - 1 - first,
        "tail_s": round(end - tail_from, 3),
        "epoch_s": round(end - start, 3),
        "real_batches": [sum(not row["pad"] for row in x["rows"]) for x in logs],
        "tokens": [sum(row["tokens"] for row in x["rows"]) for x in logs],
        "last_real_step": last_real,
    }


def one(sharding: str, a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={a.ranks}", __file__, "--worker", str(out),
            "--sharding", sharding, "--samples", str(a.samples), "--width", str(a.width),
            "--epochs", str(a.epochs),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
        t = time.monotonic()
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=a.timeout, check=False
        )
        wall = round(time.monotonic() - t, 2)
        base = {"sharding": sharding, "launch_s": wall}
        if proc.returncode != 0:
            log = (proc.stdout + proc.stderr)[-3000:]
            raise RunFailed(f"{sharding}: torchrun exited {proc.returncode}\n{log}")
        return {**base, "epochs": facts(out, a.ranks, a.samples)}


def median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs)


KEYS = ("epoch_steps", "tail_steps", "tail_s", "epoch_s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs per sharding (default 3)")
    p.add_argument("--samples", type=int, default=160, help="dataset size (default 160)")
    p.add_argument("--ranks", type=int, default=4, help="torchrun ranks (default 4)")
    p.add_argument("--width", type=int, default=768, help="MLP width: work per token (default 768)")
    p.add_argument(
        "--epochs",
        type=int,
        default=2,
        help="epochs per run (default 2: the second's deals priced by the table learned "
        "in the first, under dynamic sharding)",
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds per torchrun")
    p.add_argument("--json", action="store_true", help="one JSON object: every run and medians")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--sharding", choices=SHARDINGS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in ("repeats", "samples", "ranks", "width", "epochs"):
        if getattr(a, name) < 1:
            p.error(f"--{name}={getattr(a, name)} must be >= 1")
    if a.worker:
        a.out = a.worker
        worker(a)
        return
    load0 = os.getloadavg()
    runs: list[dict[str, Any]] = []
    for rep in range(a.repeats):
        for sh in SHARDINGS:
            r = {"repeat": rep, **one(sh, a)}
            runs.append(r)
            if not a.json:
                print(json.dumps(r), flush=True)
    med = {
        sh: [
            {k: median([r["epochs"][e] for r in runs if r["sharding"] == sh], k) for k in KEYS}
            for e in range(a.epochs)
        ]
        for sh in SHARDINGS
    }
    ratio = [
        {
            k: (med["dynamic"][e][k] / med["static"][e][k] if med["static"][e][k] else None)
            for k in KEYS
        }
        for e in range(a.epochs)
    ]
    load = os.getloadavg()
    config = {k: getattr(a, k) for k in ("repeats", "samples", "ranks", "width", "epochs")}
    if a.json:
        out = {
            "config": config,
            "runs": runs,
            "medians": med,
            "ratio": ratio,
            "loadavg_before": load0,
            "loadavg_after": load,
        }
        print(json.dumps(out))
        return
    print(f"\nmedians of {a.repeats} runs, {a.ranks} gloo ranks, {a.samples} samples")
    for e in range(a.epochs):
        priced = sorted({r["epochs"][e]["priced_ids"] for r in runs if r["sharding"] == "dynamic"})
        how = f"dynamic priced by a table of {priced} ids" if e and any(priced) else "mean"
        print(f"epoch {e + 1} (deals: {how})")
        print(f"{'':12}{'static':>10}{'dynamic':>10}{'dyn/static':>12}")
        for k in KEYS:
            rt = "-" if ratio[e][k] is None else f"{ratio[e][k]:.2f}"
            print(f"{k:12}{med['static'][e][k]:>10.3g}{med['dynamic'][e][k]:>10.3g}{rt:>12}")
    for when, la in (("before", load0), ("after", load)):
        print(f"load average {when}: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")


if __name__ == "__main__":
    main()
