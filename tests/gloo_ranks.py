"""Run a function on W real gloo ranks (spawned processes on 127.0.0.1) and collect
what each returns; `target` is "module:function", the function
`(rank, world, spec) -> dict` (JSON-serialisable). A rank that raises reports
`{"ok": False, "error": ...}`; one that writes nothing (killed, hung) reports None."""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from guards import HANG_GUARD_S

from odb_core.bench.launch import free_port, init_local_gloo, release_child_resources


def set_rank_env(rank: int, world: int, port: int, **extra: str) -> None:
    """The environment torchrun gives a worker on one local node (what Accelerate,
    Lightning and HF read to find their rank), for ranks spawned by hand."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


def _entry(rank: int, world: int, port: int, target: str, spec: dict[str, Any], out: str) -> None:
    init_local_gloo(rank, world, port, timeout_s=HANG_GUARD_S)
    module, name = target.split(":")
    try:
        result = {"ok": True, **getattr(importlib.import_module(module), name)(rank, world, spec)}
    except BaseException as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    release_child_resources()
    os._exit(0)  # a peer may be gone: skip destroy_process_group's handshake


def launch(
    target: str,
    world: int,
    spec: dict[str, Any],
    out: Path,
    timeout: float = HANG_GUARD_S,
    hung: Collection[int] = (),
) -> list[dict[str, Any] | None]:
    """`hung`: ranks a test makes hang on purpose; only the others are waited for
    (until `timeout`), then every rank still alive is killed."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, target, spec, str(out)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for r, p in enumerate(procs):
        if r not in hung:
            p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results: list[dict[str, Any] | None] = []
    for r in range(world):
        f = out / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    return results


def ok(results: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} wrote no result (killed or hung)"
        assert res["ok"], f"rank {r} failed: {res['error']}"
    return [r for r in results if r is not None]


def launch_entry(
    entry: Callable[..., None], world: int, out: Path, *extra: Any, timeout: float
) -> list[dict[str, Any]]:
    """Spawn `entry(rank, world, port, out, *extra)` on `world` ranks, each writing
    `rank{r}.pt` (its result) or `rank{r}.err` (its traceback), and return the
    results. A rank that failed, wrote nothing, or still runs at `timeout` (then
    killed) fails the test."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=entry, args=(r, world, port, str(out), *extra)) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    for r in range(world):
        err = out / f"rank{r}.err"
        assert not err.exists(), f"rank {r} failed:\n{err.read_text()}"
        f = out / f"rank{r}.pt"
        assert f.exists(), f"rank {r} wrote no result" + (" (hung, killed)" if r in hung else "")
        results.append(torch.load(f, weights_only=False))
    assert not hung, f"ranks {hung} still running after {timeout}s (hung)"
    return results
