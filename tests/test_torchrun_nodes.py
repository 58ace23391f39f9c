"""Two torchrun launches on 127.0.0.1 as two "nodes" (c10d rendezvous): a fixed
two-node group, and an elastic one (`--nnodes=1:2`) that a node joins at a restart,
which resumes at the new world size from the last checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from torchrun_runs import (
    HANG_GUARD_S,
    check_run,
    kill,
    launch,
    listening,
    start,
    steps_logged,
    wait_for,
)

from odb_core.bench.launch import free_port

SAMPLES, EVERY = 160, 4


def elastic_flags(last_call_s: int, keep_alive: str = "") -> list[str]:
    """One node of an elastic group of 1 or 2, one restart; the rendezvous closes
    `last_call_s` after the minimum of nodes is there; `keep_alive`: extra
    rendezvous settings for the heartbeats."""
    conf = f"last_call_timeout={last_call_s},join_timeout=60{keep_alive}"
    return [
        "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=1", "--monitor-interval=0.2",
        f"--rdzv-conf={conf}",
    ]  # fmt: skip


def test_two_nodes_train_every_id_once_with_equal_steps(tmp_path: Path) -> None:
    node = ["--nnodes=2", "--nproc_per_node=2"]
    args = ["--samples", str(SAMPLES), "--every", str(EVERY), "--epochs", "2"]
    codes = launch(tmp_path, [[*node, "--node_rank=0"], [*node, "--node_rank=1"]], worker=args)
    assert codes == [0, 0], (tmp_path / "torchrun0.txt").read_text()[-3000:]
    facts = check_run(tmp_path, SAMPLES, 2, EVERY)
    assert facts["worlds"] == [4] and facts["resume"] is None


def test_elastic_size_a_node_joins_and_the_loader_resumes_at_world_two(tmp_path: Path) -> None:
    """--nnodes=1:2: node A trains alone (world 1); node B joins, torchrun restarts
    A's worker and both resume at world 2 from the last checkpoint (a list of every
    old rank's states loads at any world size). Workers get a store of their own
    per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): with the shared agent store,
    torch 2.13's agent does not publish the store address for the new round and
    the joining node waits for it until its timeout (docs/ELASTIC.md)."""
    flags = elastic_flags(last_call_s=1)
    args = ["--samples", str(SAMPLES), "--every", str(EVERY), "--step-sleep", "0.1"]
    port = free_port()
    a = start(tmp_path, 0, flags, port, args, share_store=False)
    b = None
    try:
        wait_for(lambda: steps_logged(tmp_path, 1) >= 6, "node A alone", [a])
        b = start(tmp_path, 1, flags, port, args, share_store=False)
        codes = [a.wait(timeout=HANG_GUARD_S), b.wait(timeout=HANG_GUARD_S)]
        assert codes == [0, 0], (tmp_path / "torchrun0.txt").read_text()[-3000:]
    finally:
        kill(a)
        if b is not None:
            kill(b)
    facts = check_run(tmp_path, SAMPLES, 1, EVERY)
    assert facts["worlds"] == [1, 2]
    first, joined = facts["resumes"]
    assert first is None and joined is not None
    assert joined["world_size"] == 2 and joined["samples_done"] > 0


def test_elastic_size_a_node_leaves_and_the_loader_resumes_at_world_one(tmp_path: Path) -> None:
    """--nnodes=1:2: nodes A and B train at world 2; B is kill -9'd (its torchrun and
    worker). A's worker fails on the lost peer, torchrun restarts it, the rendezvous
    closes with A alone, and it resumes at world 1 from the last complete checkpoint
    (both old ranks' states): every id once, but for the replay since it.

    The rendezvous drops B once it missed its heartbeats: one a second, five
    missed (torch's default, 5 s x 3, made this test wait 15 s). The steps sleep
    until A resumed alone (B must be killed mid-epoch), not after."""
    flags = elastic_flags(5, keep_alive=",keep_alive_interval=1,keep_alive_max_attempt=5")
    args = ["--samples", str(SAMPLES), "--every", str(EVERY), "--step-sleep", "0.5"]
    args += ["--sleep-until-shrunk"]
    port = free_port()
    a = start(tmp_path, 0, flags, port, args, share_store=False)
    b = None
    try:
        # A hosts the rendezvous store (the first to bind the port does): B's death
        # must not take the store with it.
        wait_for(lambda: listening(port), "node A's rendezvous store", [a])
        b = start(tmp_path, 1, flags, port, args, share_store=False)
        wait_for(lambda: steps_logged(tmp_path, 2) >= EVERY + 2, "world 2 steps", [a, b])
        kill(b)
        assert a.wait(timeout=HANG_GUARD_S) == 0, (tmp_path / "torchrun0.txt").read_text()[-3000:]
    finally:
        kill(a)
        if b is not None:
            kill(b)
    facts = check_run(tmp_path, SAMPLES, 1, EVERY)
    # A may run alone (world 1) for a moment before B joins: what matters is the end
    assert facts["worlds"][-2:] == [2, 1]
    left = facts["resumes"][-1]
    assert left is not None and left["world_size"] == 1 and left["samples_done"] > 0
    assert facts["replayed_steps"] <= EVERY
