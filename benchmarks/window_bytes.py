"""The window's byte bound (issue 36): host memory, samples/s and padding by budget.

    nice .venv/bin/python benchmarks/window_bytes.py [--samples 160] [--repeats 1]
        [--budget-mib 0 --budget-mib 1024 ...] [--json]

Two real gloo ranks (spawned processes), each an `ODBDataLoader` with 2 forked
DataLoader workers over a synthetic VLM mix shaped like issue 36's Qwen3-VL run
(patch 16, temporal 2, merge 2: 1,536 float32 per patch, 4 patches per visual
token, the visual tokens in `input_ids`): 25% text only, 35% one medium image,
20% one huge image capped at 4,096 patches (`max_pixels`), 15% two to four
images, 5% stacks of 8 frames. Padded cost (the issue's default window of 1,024
samples), `token_budget` 8,192. The loader is iterated alone (no model), as in
the issue.

Per rank and budget: peak RSS of the rank and its workers together, less
their shared-memory mappings (RssAnon + RssFile of /proc/PID/status, children
found by psutil, sampled every 20 ms; the mappings are counted once, in
/dev/shm), peak /dev/shm in use (statvfs of the whole tmpfs, less its use
before the run, divided by the ranks: the workers hand samples over through
unlinked shared-memory files that `du` does not see), their sum, the loader's
own `epoch_stats.window_bytes_peak` / `window_samples_mean`, samples/s (the
rank's samples over its epoch's wall time) and padding `1 - real / padded
tokens`. Budgets are interleaved per repeat; medians.

These runs hold a few hundred samples per rank, less than the default window of
1,024, so their padding says little about a real epoch: first, the core alone
(`core_padding`: one rank's `RankMachine` over `--core-samples` samples of the
same mix, each observed with its size) gives the padding and mean window at
full scale for every budget. `--core-only` stops there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.multiprocessing as mp
from torch.utils.data import Dataset

from odb_core import ODBDataLoader
from odb_core.bench.launch import free_port, init_local_gloo, release_child_resources
from odb_core.config import ProtocolConfig, default_buffer_size
from odb_core.cost import Budget, CostKind, PaddedTokens
from odb_core.protocol import RankMachine, RankPhase
from odb_core.sample import Sample

PATCH_FLOATS = 3 * 2 * 16 * 16  # channels x temporal patch x 16 x 16
MERGE = 4  # patches per visual token (2 x 2)
MIB = 1 << 20


def _images(rng: random.Random) -> tuple[list[int], int]:
    """Patches of each image of one sample, and its text tokens."""
    kind = rng.random()
    text = rng.randint(40, 400)
    if kind < 0.25:
        return [], rng.randint(60, 900)
    if kind < 0.60:
        return [rng.randint(256, 1600)], text
    if kind < 0.80:
        return [4096], text  # capped by max_pixels
    if kind < 0.95:
        return [rng.randint(256, 1200) for _ in range(rng.randint(2, 4))], text
    return [256] * 8, text  # frames


class VLMMix(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.items = [_images(rng) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        patches, text = self.items[i]
        total = sum(patches)
        return {
            "input_ids": torch.full((text + total // MERGE,), i, dtype=torch.int64),
            "pixel_values": torch.rand(total, PATCH_FLOATS),
            "image_grid_thw": torch.tensor([[1, p, 1] for p in patches], dtype=torch.int64),
        }


def lengths(samples: list[dict[str, torch.Tensor]]) -> list[int]:
    """The collate function: each sample's length (the padding is computed from it)."""
    return [len(s["input_ids"]) for s in samples]


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _rss(pid: int) -> int:
    """RSS less its shared-memory mappings (RssAnon + RssFile), which /dev/shm counts."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    kib = {
        k: int(v.split()[0])
        for k, _, v in (ln.partition(":") for ln in text.splitlines())
        if k in ("RssAnon", "RssFile")
    }
    return 1024 * sum(kib.values())


class Sampler(threading.Thread):
    """Peak RSS of this process and its children, and peak /dev/shm in use."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process()
        self.rss = 0
        self.shm = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            rss = _rss(self.proc.pid)
            for c in self.proc.children(recursive=True):
                rss += _rss(c.pid)
            self.rss = max(self.rss, rss)
            self.shm = max(self.shm, shm_used())
            time.sleep(0.02)


def run_rank(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    init_local_gloo(rank, world, port, timeout_s=300)
    loader = ODBDataLoader(
        VLMMix(spec["samples"] * world, seed=spec["seed"]),
        token_budget=8192,
        cost_model="padded",
        window_bytes=spec["window_bytes"],
        collate_fn=lengths,
        step_meta=False,
        num_workers=2,
        multiprocessing_context="fork",
        peer_timeout=300,
    )
    sampler = Sampler()
    sampler.start()
    start = time.perf_counter()
    real = padded = samples = 0
    for batch in loader:
        info = loader.step_info
        assert info is not None
        if not info.is_pad:
            real += sum(batch)
            padded += len(batch) * max(batch)
            samples += len(batch)
    wall = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    stats = loader.epoch_stats
    assert stats is not None
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rss": sampler.rss,
                "shm": sampler.shm,
                "window_bytes_peak": stats.window_bytes_peak,
                "window_samples_mean": stats.window_samples_mean,
                "window_samples_peak": stats.window_samples_peak,
                "samples_per_s": samples / wall,
                "padding": 1 - real / padded if padded else 0.0,
            }
        )
    )
    loader.close()
    release_child_resources()
    os._exit(0)


def run(window_bytes: int, spec: dict[str, Any], out: Path, world: int = 2) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.json"):
        f.unlink()
    base = shm_used()
    ctx = mp.get_context("spawn")
    port = free_port()
    rank_spec = {**spec, "window_bytes": window_bytes}
    procs = [
        ctx.Process(target=run_rank, args=(r, world, port, rank_spec, str(out)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
    rows = []
    for r in range(world):
        row = json.loads((out / f"rank{r}.json").read_text())
        row["shm"] = max(0, row["shm"] - base) / world
        row["host"] = row["rss"] + row["shm"]
        rows.append(row)
    return rows


def core_padding(samples: int, bound: int | None, seed: int) -> tuple[float, float]:
    """Padding and the mean window (samples) of one rank's core alone over `samples`
    samples of the mix, at the padded default window (1,024) and `bound`: what the
    former sees at full scale, which the loader runs above are too small to show."""
    config = ProtocolConfig(
        world_size=1,
        budget=Budget(8192),
        cost_model=PaddedTokens(),
        buffer_size=default_buffer_size(CostKind.PADDED),
        window_bytes=bound,
    )
    m = RankMachine(0, config)
    items = VLMMix(samples, seed).items
    stream = iter(
        (Sample(i, t + sum(p) // MERGE), 4 * PATCH_FLOATS * sum(p))
        for i, (p, t) in enumerate(items)
    )
    sizes: dict[int, int] = {}
    real = padded = 0
    windows: list[int] = []

    def pull() -> Sample | None:
        nxt = next(stream, None)
        if nxt is None:
            return None
        sizes[nxt[0].id] = nxt[1]
        windows.append(len(m.buffer) + 1)
        return nxt[0]

    while m.phase is not RankPhase.DONE:
        c = m.fill(pull, None, lambda s: sizes[s.id])
        for info in m.all_gather([c]).steps:
            if info.batch is not None:
                lens = [s.tokens for s in info.batch.samples]
                real += sum(lens)
                padded += len(lens) * max(lens)
    return 1 - real / padded, statistics.mean(windows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=160, help="samples per rank")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--budget-mib",
        type=int,
        action="append",
        help="window_bytes in MiB (0: unbounded); default 0, 2048, 1024, 512, 256",
    )
    ap.add_argument("--out", default="/tmp/odb-window-bytes")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--core-samples", type=int, default=4000, help="samples of the core-only padding run"
    )
    ap.add_argument("--core-only", action="store_true", help="skip the loader runs")
    args = ap.parse_args()
    budgets = args.budget_mib or [0, 2048, 1024, 512, 256]
    spec = {"samples": args.samples, "seed": args.seed}
    sizes = [
        4 * PATCH_FLOATS * sum(p) + 8 * (t + sum(p) // MERGE)
        for p, t in VLMMix(args.samples * 2, args.seed).items
    ]
    core = {b: core_padding(args.core_samples, b * MIB or None, args.seed) for b in budgets}
    print(
        f"core alone, {args.core_samples} samples, window 1,024 (padded default): "
        + ", ".join(
            f"{'unbounded' if b == 0 else f'{b} MiB'}: padding {100 * p:.1f}% (mean window {w:.0f})"
            for b, (p, w) in core.items()
        )
    )
    if args.core_only:
        return
    results: dict[int, list[dict[str, Any]]] = {b: [] for b in budgets}
    for _ in range(args.repeats):
        for b in budgets:
            results[b].extend(run(b * MIB, spec, Path(args.out)))
    keys = ["host", "rss", "shm", "window_bytes_peak", "window_samples_mean"]
    keys += ["samples_per_s", "padding"]
    table = {
        b: {k: statistics.median(r[k] for r in rows) for k in keys} for b, rows in results.items()
    }
    if args.json:
        print(json.dumps({"mean_sample_mib": statistics.mean(sizes) / MIB, "budgets": table}))
        return
    print(
        f"{args.samples} samples per rank, 2 ranks x 2 workers, mean sample "
        f"{statistics.mean(sizes) / MIB:.1f} MiB; medians over ranks and {args.repeats} repeat(s)"
    )
    print(
        f"{'window_bytes':>12} {'RSS+shm GiB':>11} {'RSS GiB':>8} {'shm GiB':>8} "
        f"{'held peak GiB':>13} {'window mean':>11} {'samples/s':>9} {'padding':>7}"
    )
    base = table.get(0)
    for b, row in table.items():
        label = "unbounded" if b == 0 else f"{b} MiB"
        rel = f" ({row['samples_per_s'] / base['samples_per_s']:.2f}x)" if base else ""
        print(
            f"{label:>12} {row['host'] / (1 << 30):>11.2f} {row['rss'] / (1 << 30):>8.2f} "
            f"{row['shm'] / (1 << 30):>8.2f} {row['window_bytes_peak'] / (1 << 30):>13.2f} "
            f"{row['window_samples_mean']:>11.1f} {row['samples_per_s']:>9.1f}{rel} "
            f"{100 * row['padding']:>6.1f}%"
        )


if __name__ == "__main__":
    main()
