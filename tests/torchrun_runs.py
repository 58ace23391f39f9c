"""Launch tests/torchrun_worker.py under real torchrun (one or more localhost
"nodes", c10d rendezvous) and check its step logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from odb_core.torch.launch import free_port

WORKER = str(Path(__file__).with_name("torchrun_worker.py"))
HANG_GUARD_S = 240


def launch(
    out: Path, nodes: list[list[str]], port: int | None = None, worker: list[str] = ()
) -> list[int]:
    """One torchrun per entry of `nodes` (its extra torchrun flags), all at once; the
    exit codes. Every launch is killed (its whole process group) on a hang."""
    port = port or free_port()
    procs = []
    for i, flags in enumerate(nodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=odb", *flags,
            WORKER, str(out), *worker,
        ]  # fmt: skip
        log = open(out / f"torchrun{i}.txt", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
    try:
        return [p.wait(timeout=HANG_GUARD_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def rows(out: Path, attempt: int) -> dict[int, list[dict[str, Any]]]:
    """Rank -> log rows of one attempt."""
    got: dict[int, list[dict[str, Any]]] = {}
    for f in sorted(out.glob(f"log.a{attempt}.r*.w*")):
        rank = int(f.name.split(".")[2][1:])
        got[rank] = [json.loads(line) for line in f.read_text().splitlines()]
    return got


def check_run(out: Path, samples: int, epochs: int, every: int) -> dict[str, Any]:
    """Equal steps in the last attempt, and per epoch every id trained exactly once
    but for the replay since the checkpoint it resumed from (bounded by `every`).
    Returns the replay facts."""
    attempts = sorted({int(f.name.split(".")[1][1:]) for f in out.glob("log.a*")})
    last = rows(out, attempts[-1])
    assert last, "the last attempt logged nothing"
    resumes = {json.dumps(r[0]["resume"]) for r in last.values() if r and "resume" in r[0]}
    resume = json.loads(resumes.pop()) if resumes else None
    assert not resumes, "ranks resumed from different checkpoints"
    for epoch in range(epochs):
        lens = {rk: sum(1 for x in r if x.get("epoch") == epoch) for rk, r in last.items()}
        assert len(set(lens.values())) == 1, f"epoch {epoch}: unequal steps {lens}"
    replay: list[int] = []
    replay_steps: set[int] = set()
    for epoch in range(epochs):
        seen: Counter[int] = Counter()
        for a in attempts[:-1]:
            for r in rows(out, a).values():
                for x in r:
                    if x.get("epoch") != epoch or x["pad"]:
                        continue
                    later = resume is None or (epoch, x["step"]) >= (
                        resume["epoch"],
                        resume["step"],
                    )
                    if later:
                        replay += x["ids"]
                        replay_steps.add(x["step"])
                    else:
                        seen.update(x["ids"])
        for r in last.values():
            seen.update(i for x in r if x.get("epoch") == epoch and not x["pad"] for i in x["ids"])
        twice = sorted(i for i, n in seen.items() if n != 1)
        assert not twice, f"epoch {epoch}: ids trained {[(i, seen[i]) for i in twice[:5]]} times"
        assert set(seen) == set(range(samples)), f"epoch {epoch}: ids lost"
    assert len(replay_steps) <= every, f"replayed steps {sorted(replay_steps)} > {every}"
    return {"resume": resume, "replayed_ids": len(replay), "replayed_steps": len(replay_steps)}
