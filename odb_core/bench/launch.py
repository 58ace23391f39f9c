"""Start and end a local gloo rank in a child process (the bench and the tests)."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import socket
import sys

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
