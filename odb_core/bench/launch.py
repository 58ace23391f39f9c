"""Local gloo ranks in child processes: start and end one (the bench and the tests),
and run a job on W of them, killing ranks that outlive a deadline (`odb bench`,
`odb bench --model`)."""

from __future__ import annotations

import atexit
import datetime
import gc
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    """A free TCP port on the loopback interface for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def init_local_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join a gloo process group that rendezvouses on 127.0.0.1:`port`."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def release_child_resources() -> None:
    """Shut DataLoader workers down before a multiprocessing child exits.

    torch stops persistent workers in an atexit hook, which a multiprocessing
    child never runs, and a forkserver worker's watchdog watches the forkserver,
    not this process, so without this the workers outlive their rank.
    """
    gc.collect()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


@dataclass(frozen=True)
class Ranks:
    """How a run of local ranks ended: rank 0's result, if it wrote one; the first
    error a rank recorded (rank 0's wins), if any; every rank's exit code (a hung
    rank was killed); whether any rank outlived the deadline."""

    result: Any
    error: str | None
    exit_codes: list[int | None]
    hung: bool

    @property
    def ok(self) -> bool:
        """Every rank exited 0 in time and rank 0 wrote its result."""
        return not self.hung and all(c == 0 for c in self.exit_codes) and self.result is not None


def run_ranks(
    job: Callable[..., Any],
    world: int,
    *job_args: Any,
    timeout: float,
    gloo_timeout_s: float,
    prefix: str = "odb-ranks-",
) -> Ranks:
    """Run `job(rank, world, *job_args)` on `world` local gloo ranks, each a spawned
    child process; rank 0's return value (JSON-serialisable) is the result.

    The ranks share one deadline, `timeout` seconds from the start: a rank still
    alive then is killed. `job` and `job_args` must pickle (a module-level function).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        out = Path(tmp) / "result.json"
        err = Path(tmp) / "error.txt"
        port = free_port()
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(
                target=_rank_entry,
                args=(r, world, port, gloo_timeout_s, job, job_args, str(out), str(err)),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        return Ranks(
            result=json.loads(out.read_text()) if out.exists() else None,
            error=err.read_text() if err.exists() else None,
            exit_codes=[p.exitcode for p in procs],
            hung=bool(hung),
        )


def _rank_entry(
    rank: int,
    world: int,
    port: int,
    gloo_timeout_s: float,
    job: Callable[..., Any],
    job_args: tuple[Any, ...],
    out: str,
    err: str,
) -> None:
    init_local_gloo(rank, world, port, timeout_s=gloo_timeout_s)
    try:
        result = job(rank, world, *job_args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    except BaseException as exc:
        if rank == 0 or not Path(err).exists():
            Path(err).write_text(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise
    finally:
        dist.destroy_process_group()
        release_child_resources()
