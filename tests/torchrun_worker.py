"""A training loop under torchrun (tests/test_torchrun_*.py): joins the group through
odb_core.torch.elastic, resumes from the newest complete checkpoint under `out`,
logs each step's ids, checkpoints every `every` steps, and kill -9s itself where
told (`--kill-rank` at `--kill-step` of attempt 0)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from odb_core import ODBDataLoader, ODBPeerError
from odb_core.torch.elastic import attempt_prefix, init_process_group


def collate(batch: list[dict[str, list[int]]]) -> int:
    return len(batch)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--samples", type=int, default=120)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    # A test that needs the group slow only until a node leaves: no sleep once the
    # group resumed at a smaller world size than the checkpoint's.
    p.add_argument("--sleep-until-shrunk", action="store_true")
    # torchrun SIGTERMs the other workers as soon as its monitor sees one die, which
    # can come before a survivor has heard of the failure and said whom it blames:
    # a test of what survivors report ignores SIGTERM (torchrun SIGKILLs after 30 s).
    p.add_argument("--ignore-sigterm", action="store_true")
    a = p.parse_args()
    if a.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ds = [{"input_ids": list(range(1 + (i * 7) % 13))} for i in range(a.samples)]
    loader = ODBDataLoader(ds, token_budget=24, collate_fn=collate, num_workers=a.workers)
    done = sorted(d for d in glob.glob(f"{a.out}/ckpt/*") if _complete(d))
    if done:
        d = done[-1]
        files = sorted(Path(d).glob("rank*.json"))
        states = [json.loads(f.read_text()) for f in files]
        loader.load_state_dict(states)
        if a.sleep_until_shrunk and len(states) > world:
            a.step_sleep = 0.0
    # one log per incarnation of the group: a failure restart bumps `attempt`, a
    # node joining or leaving (--nnodes=MIN:MAX) changes `world`
    tag = f"{a.out}/log.{attempt}-{world}.r{rank}"
    try:
        train(a, loader, tag, rank, attempt)
    except ODBPeerError as exc:  # what this rank was told, for the test to read
        fault = {"ranks": list(exc.ranks), "cause": str(exc.cause), "message": str(exc)}
        Path(f"{a.out}/error.{attempt}-{world}.r{rank}.json").write_text(json.dumps(fault))
        raise
    dist.barrier()
    dist.destroy_process_group()


def _complete(d: str) -> bool:
    """A checkpoint holds the state of every rank of the group that wrote it."""
    worlds = glob.glob(f"{d}/world-*")
    if len(worlds) != 1:
        return False
    return len(glob.glob(f"{d}/rank*.json")) == int(worlds[0].rsplit("-", 1)[1])


def train(a: argparse.Namespace, loader: ODBDataLoader, tag: str, rank: int, attempt: int) -> None:
    rep = loader.resume_report
    first = 0 if rep is None else rep.epoch + rep.closed
    with open(tag, "a") as log:
        log.write(json.dumps({"start": time.time(), "prefix": attempt_prefix()}) + "\n")
        if rep is not None:
            log.write(json.dumps({"resume": rep.to_dict()}) + "\n")
        for epoch in range(first, a.epochs):
            loader.set_epoch(epoch)
            for _ in loader:
                info = loader.step_info
                assert info is not None
                row = {"epoch": epoch, "step": info.step, "pad": info.is_pad}
                log.write(json.dumps({**row, "ids": list(info.sample_ids)}) + "\n")
                log.flush()
                if attempt == 0 and rank == a.kill_rank and info.step == a.kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(a.step_sleep)
                if (info.step + 1) % a.every == 0:
                    # Complete once every rank's file is in place (each written whole,
                    # by rename), before the barrier: no write after it can be lost to
                    # a peer's kill, however loaded the machine.
                    d = f"{a.out}/ckpt/{epoch:03d}-{info.step + 1:06d}"
                    os.makedirs(d, exist_ok=True)
                    Path(d, f"world-{dist.get_world_size()}").touch()
                    with open(f"{d}/.rank{rank}.tmp", "w") as f:
                        json.dump(loader.state_dict(), f)
                    os.replace(f"{d}/.rank{rank}.tmp", f"{d}/rank{rank}.json")
                    dist.barrier()
            log.write(json.dumps({"end": epoch}) + "\n")


if __name__ == "__main__":
    main()
