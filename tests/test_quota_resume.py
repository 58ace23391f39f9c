"""Quota mode plus resume through the real loader, at world size 1 and 2.

The two ranks run in one process, on threads, over an in-memory all-gather
(tests/thread_ranks.py), so the multi-rank paths of ODBDataLoader (global counts,
merged states, the ledger exchange at the close) run in seconds.
Checked across an interruption: the ledger at the close holds exactly the ids
no incarnation emitted, the resumed quota counts the samples emitted before
the checkpoint (the epoch closes at the very step the global count reaches the
quota), and a state's `emitted` is the global count, not this rank's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from thread_ranks import RankLoader, Result, on_ranks, to_the_end, until  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.config import Mode, ProtocolConfig  # noqa: E402
from odb_core.cost import Budget  # noqa: E402
from odb_core.protocol import RankMachine  # noqa: E402
from odb_core.step import StepInfo  # noqa: E402
from odb_core.torch.measure import LossTokens  # noqa: E402
from odb_core.torch.pipeline import EpochPipeline  # noqa: E402
from odb_core.torch.rounds import EpochSetup, _End  # noqa: E402
from odb_core.torch.transport import LocalTransport  # noqa: E402

pytestmark = pytest.mark.torch

N, QUOTA = 48, 30


class Text(Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": torch.zeros(1 + (i * 7919) % 23, dtype=torch.int64)}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ids = [s["input_ids"] for s in samples]
    return {"input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)}


KW: dict[str, Any] = {
    "token_budget": 64,
    "buffer_size": 4,
    "max_steps_per_round": 2,
    "mode": "quota",
    "quota": QUOTA,
    "shuffle": True,
    "collate_fn": collate,
    # Per-rank states and the re-deal of a carry over fixed shards: static sharding
    # (dynamic quota resumes: tests/test_quota_dynamic.py).
    "sharding": "static",
}


def fresh(state: Any = None, **kw: Any) -> Callable[[Any], ODBDataLoader]:
    def make(transport: Any) -> ODBDataLoader:
        loader = RankLoader(transport, Text(N), **{**KW, **kw})
        if state is not None:
            loader.load_state_dict(state)
        return loader

    return make


def global_counts(infos: list[StepInfo]) -> list[int]:
    return [info.global_samples for info in infos]


def check_quota_cut(before: list[int], after: list[int]) -> None:
    """The epoch closed at the first step at which the global count reached the quota."""
    counts = before + after
    assert sum(counts) >= QUOTA
    assert sum(counts[:-1]) < QUOTA


def check_ledger(parts: list[list[Result]]) -> None:
    """Every id of the pass: emitted once by one incarnation's rank, or in the ledger
    (the same on every rank)."""
    emitted = [i for results in parts for r in results for i in r.ids]
    last = parts[-1]
    ledgers = {tuple(r.loader.ledger) for r in last}
    assert len(ledgers) == 1
    ledger = list(ledgers.pop())
    assert ledger, "the quota carried nothing: this checks nothing"
    assert sorted(emitted + ledger) == list(range(N))
    for r in last:
        assert sorted(i for part in r.state["carry"] for i in part) == sorted(ledger)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stop", [1, 3])
def test_local_resume_keeps_the_ledger_and_the_quota_exact(world: int, stop: int) -> None:
    before = on_ranks(world, fresh(), until(stop))
    emitted = sum(global_counts(before[0].infos))
    assert 0 < emitted < QUOTA
    for r in before:
        assert r.state["emitted"] == emitted, "a state counts the global samples emitted"
        assert not r.state["closed"]
    after = on_ranks(
        world, lambda t: fresh(before[t.rank if world > 1 else 0].state)(t), to_the_end
    )
    assert after[0].infos[0].step == stop
    check_quota_cut(global_counts(before[0].infos), global_counts(after[0].infos))
    check_ledger([before, after])


@pytest.mark.parametrize(("w1", "w2"), [(2, 1), (1, 2), (2, 2)])
def test_merged_resume_at_any_world_size_keeps_the_ledger_and_the_quota_exact(
    w1: int, w2: int
) -> None:
    before = on_ranks(w1, fresh(), until(2))
    states = [r.state for r in before]
    after = on_ranks(w2, fresh(states), to_the_end)
    assert after[0].infos[0].step == 2
    check_quota_cut(global_counts(before[0].infos), global_counts(after[0].infos))
    check_ledger([before, after])


@pytest.mark.parametrize("world", [1, 2])
def test_exact_resume_replays_the_uninterrupted_quota_epoch(world: int) -> None:
    whole = on_ranks(world, fresh(deterministic=True), until(-1))
    before = on_ranks(world, fresh(deterministic=True), until(2))
    after = on_ranks(
        world,
        lambda t: fresh(before[t.rank if world > 1 else 0].state, deterministic=True)(t),
        to_the_end,
    )
    for r in range(world):
        assert [i.sample_ids for i in whole[r].infos] == [
            i.sample_ids for i in before[r].infos + after[r].infos
        ]
        assert list(after[r].loader.ledger) == list(whole[r].loader.ledger)
    check_quota_cut(global_counts(before[0].infos), global_counts(after[0].infos))
    check_ledger([before, after])


@pytest.mark.parametrize("world", [1, 2])
def test_a_resume_inside_a_pass_that_started_with_a_carry(world: int) -> None:
    """Epoch 0 closes with a ledger; epoch 1 (which reads it first) is interrupted and
    resumed: its own ledger still covers exactly what neither incarnation emitted."""

    def first_then_part(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
        to_the_end(loader)
        assert loader.ledger
        return until(2, epoch=1)(loader)

    before = on_ranks(world, fresh(), first_then_part)
    carried = set(before[0].loader.carried_in)
    assert carried
    after = on_ranks(
        world, lambda t: fresh(before[t.rank if world > 1 else 0].state)(t), to_the_end
    )
    emitted = {i for res in (before, after) for r in res for i in r.ids}
    assert carried <= emitted
    check_quota_cut(global_counts(before[0].infos), global_counts(after[0].infos))
    check_ledger([before, after])


def test_the_close_leaves_resume_excluded_ids_out_of_the_ledger() -> None:
    """The pipeline's ledger is the shard less what this incarnation emitted and less
    what the resumed state excludes, even when the shard still lists excluded ids."""
    config = ProtocolConfig(
        world_size=1, budget=Budget(64), buffer_size=2, mode=Mode.QUOTA, quota=3
    )
    excluded = frozenset({0, 1})
    shard = list(range(10))
    records = [[(i, {"input_ids": torch.zeros(5, dtype=torch.int64)})] for i in shard]
    setup = EpochSetup(
        machine=RankMachine(0, config),
        transport=LocalTransport(),
        source=iter(records),
        tag=(0,),
        excluded=excluded,
        step_offset=0,
        collate=collate,
        cost_fn=None,
        loss_tokens=LossTokens(),
        id_fn=None,
        truncate_fn=None,
        pin=None,
        pad_fallback=lambda: records[0][0][1],
        shard=shard,
        trace_path=None,
    )
    pipeline = EpochPipeline(setup, threaded=False)
    emitted: list[int] = []
    while True:
        item = pipeline.get()
        if isinstance(item, _End):
            break
        emitted.extend(item.info.sample_ids)
    ledger = list(item.ledger[0])
    assert len(emitted) >= 3 and not set(emitted) & excluded
    assert ledger == [i for i in shard if i not in excluded and i not in emitted]


@pytest.mark.parametrize("stop", [1, 2, 3])
@pytest.mark.parametrize(("w1", "w2"), [(2, 1), (2, 2), (1, 2)])
def test_a_merged_resume_inside_a_carried_pass_re_deals_what_is_left_of_the_carry(
    w1: int, w2: int, stop: int
) -> None:
    def first_then_part(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
        to_the_end(loader)
        return until(stop, epoch=1)(loader)

    before = on_ranks(w1, fresh(buffer_size=3), first_then_part)
    carry = list(before[0].loader.carried_in)
    done = {i for r in before for i in r.ids}
    assert set(carry) & done, "the first steps of the pass read carried ids"
    states = [r.state for r in before]
    left = [i for i in carry if i not in done]

    def body(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
        it = iter(loader)
        assert loader._index_sampler is not None
        head = list(loader._index_sampler.indices[: len(left[loader.rank :: w2])])
        assert head == left[loader.rank :: w2], "the carry left is dealt like a fresh pass's"
        infos = []
        for _ in it:
            assert loader.step_info is not None
            infos.append(loader.step_info)
        return infos, loader.state_dict()

    after = on_ranks(w2, fresh(states, buffer_size=3), body)
    check_quota_cut(global_counts(before[0].infos), global_counts(after[0].infos))
    check_ledger([before, after])
