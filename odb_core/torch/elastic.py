"""Joining the default process group under torchrun so that a restart re-forms it.

Why: torchrun (torch >= 2.4, c10d rendezvous) hands its workers the agent's own
TCPStore (`TORCHELASTIC_USE_AGENT_STORE=True`), and that store lives across
restarts with no per-attempt prefix. Gloo's full-mesh connect publishes each
rank's listening address under a fixed key (`default_pg/0//cpu//0/<rank>`, and
one per `new_group`); the keys of the failed attempt are still there when the
next attempt starts. A rank that reads a peer's key before that peer rewrites it
connects to the dead attempt's address: "Connection refused" (the port is
closed), or a connect timeout after the group's timeout (the port is still held
by a process of the old attempt, e.g. a forked DataLoader worker that inherited
the listening socket). Any slower start of one rank loses that race, so a
restart fails in `init_process_group`, before any loader code runs.

`init_process_group` here is `torch.distributed.init_process_group` with the
store wrapped in a `PrefixStore(attempt_prefix())`: each attempt
sees only its own keys (the default group's, every later group's, the loader's
peer board). Outside torchrun, or where workers do not share the agent store,
it is the plain call.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from odb_core.errors import ConfigError


def shares_agent_store() -> bool:
    """Launched by torchrun with workers on the agent's long-lived store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_prefix() -> str:
    """`odb-attempt/<restart count>/<world size>/`: a failure restart bumps the
    count; a membership change (a node joins or leaves under `--nnodes=MIN:MAX`)
    does not, but changes the world size."""
    env = {k: os.environ.get(k, "0") for k in ("TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE")}
    bad = {k: v for k, v in env.items() if not v.isdigit()}
    if bad:
        raise ConfigError(f"torchrun environment malformed: {bad}")
    return "odb-attempt/{}/{}/".format(*(int(v) for v in env.values()))


def init_process_group(
    backend: str = "gloo", timeout: datetime.timedelta | None = None, **kwargs: Any
) -> None:
    """`dist.init_process_group(backend, ...)` from torchrun's environment, with the
    keys of each restart attempt apart (see the module docstring)."""
    if not shares_agent_store() or "store" in kwargs or "init_method" in kwargs:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    bad = {k: v for k, v in env.items() if v is None or (k != "MASTER_ADDR" and not v.isdigit())}
    if bad:
        raise ConfigError(f"torchrun environment incomplete or malformed: {bad}")
    wait = timeout or datetime.timedelta(minutes=10)
    agent = TCPStore(
        str(env["MASTER_ADDR"]),
        int(str(env["MASTER_PORT"])),
        int(str(env["WORLD_SIZE"])),
        is_master=False,
        timeout=wait,
    )
    store = dist.distributed_c10d.PrefixStore(attempt_prefix(), agent)
    dist.init_process_group(
        backend,
        store=store,
        rank=int(str(env["RANK"])),
        world_size=int(str(env["WORLD_SIZE"])),
        timeout=wait,
        **kwargs,
    )
