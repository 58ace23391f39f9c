"""Launch tests/torchrun_worker.py under real torchrun (one or more localhost
"nodes", c10d rendezvous) and check its step logs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from guards import HANG_GUARD_S

from odb_core.bench.launch import free_port

WORKER = str(Path(__file__).with_name("torchrun_worker.py"))


def start(
    out: Path, i: int, flags: list[str], port: int, worker: list[str], share_store: bool = True
) -> subprocess.Popen[bytes]:
    """torchrun number `i` (its own session, output in torchrun<i>.txt); without
    `share_store`, workers get a store of their own each rendezvous round."""
    env = dict(os.environ)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=odb", *flags,
        WORKER, str(out), *worker,
    ]  # fmt: skip
    with open(out / f"torchrun{i}.txt", "w") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )


def kill(p: subprocess.Popen[bytes]) -> None:
    """kill -9 a torchrun and everything it started: its session, and its workers,
    which torchrun starts in sessions of their own."""
    if p.poll() is None:
        try:
            workers = psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            workers = []
        os.killpg(p.pid, signal.SIGKILL)
        for w in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                w.kill()
        p.wait()


def launch(out: Path, nodes: list[list[str]], worker: list[str] = ()) -> list[int]:
    """One torchrun per entry of `nodes` (its extra flags), all at once; their exit
    codes. Every launch is killed (its whole session) on a hang or a failure."""
    for attempt in range(3):
        port = free_port()
        procs = [start(out, i, flags, port, list(worker)) for i, flags in enumerate(nodes)]
        try:
            codes = [p.wait(timeout=HANG_GUARD_S) for p in procs]
        finally:
            for p in procs:
                kill(p)
        if not _lost_port(out, len(nodes), codes) or attempt == 2:
            return codes
    raise AssertionError("unreachable")


def _lost_port(out: Path, n: int, codes: list[int]) -> bool:
    """torchrun's agent failed its first rendezvous before any worker started: the
    free port was taken between `free_port` and torchrun's bind (another launch
    beside this one), not a failure of the run under test; the launch is retried
    on a new port."""
    if all(c == 0 for c in codes) or any(out.glob("log.*")):
        return False
    text = "".join((out / f"torchrun{i}.txt").read_text() for i in range(n))
    return "RendezvousConnectionError" in text or "Address already in use" in text


def steps_logged(out: Path, world: int) -> int:
    """Steps rank 0 logged so far at world size `world` (any attempt)."""
    n = 0
    for f in out.glob(f"log.*-{world}.r0"):
        n += sum(1 for line in f.read_text().splitlines() if '"step"' in line)
    return n


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(cond: Callable[[], bool], what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in procs), f"a torchrun exited before {what}"
        time.sleep(0.1)


def incarnations(out: Path) -> list[dict[int, list[dict[str, Any]]]]:
    """Rank -> log rows, for each incarnation of the group in the order they started."""
    by: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for f in out.glob("log.*.r*"):
        _, inc, rank = f.name.split(".")
        lines = [json.loads(line) for line in f.read_text().splitlines()]
        by.setdefault(inc, {})[int(rank[1:])] = lines
    return sorted(by.values(), key=lambda r: min(x[0]["start"] for x in r.values()))


def _resume_of(run: dict[int, list[dict[str, Any]]]) -> dict[str, Any] | None:
    firsts = [r[1] for r in run.values() if len(r) > 1 and "resume" in r[1]]
    resumes = {json.dumps(x["resume"]) for x in firsts}
    assert len(resumes) <= 1 and len(firsts) in (0, len(run)), "ranks resumed apart"
    return json.loads(resumes.pop()) if resumes else None


def check_run(out: Path, samples: int, epochs: int, every: int) -> dict[str, Any]:
    """Equal steps in the last incarnation, and per epoch every id trained exactly
    once but for the replays: the steps an incarnation ran at or after the state the
    next one resumed from, at most `every` per restart. Returns the replay facts and
    the world size of each incarnation."""
    runs = incarnations(out)
    assert runs, "nothing logged"
    last = runs[-1]
    resumes = [_resume_of(run) for run in runs]
    for epoch in range(epochs):
        lens = {rk: sum(1 for x in r if x.get("epoch") == epoch) for rk, r in last.items()}
        assert len(set(lens.values())) == 1, f"epoch {epoch}: unequal steps {lens}"
    replay: list[int] = []
    replay_steps: list[int] = []
    for epoch in range(epochs):
        seen: Counter[int] = Counter()
        for k, run in enumerate(runs):
            cut = resumes[k + 1] if k + 1 < len(runs) else None
            replayed: set[int] = set()
            for r in run.values():
                for x in r:
                    if x.get("epoch") != epoch or x["pad"]:
                        continue
                    if k + 1 < len(runs) and (
                        cut is None or (epoch, x["step"]) >= (cut["epoch"], cut["step"])
                    ):
                        replay += x["ids"]
                        replayed.add(x["step"])
                    else:
                        seen.update(x["ids"])
            assert len(replayed) <= every, f"replayed steps {sorted(replayed)} > {every}"
            replay_steps.append(len(replayed))
        twice = sorted(i for i, n in seen.items() if n != 1)
        assert not twice, f"epoch {epoch}: ids trained {[(i, seen[i]) for i in twice[:5]]} times"
        assert set(seen) == set(range(samples)), f"epoch {epoch}: ids lost"
    return {
        "resume": resumes[-1],
        "resumes": resumes,
        "replayed_ids": len(replay),
        "replayed_steps": sum(replay_steps),
        "worlds": [len(r) for r in runs],
    }
