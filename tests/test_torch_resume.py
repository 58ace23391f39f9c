"""Resumable epoch progress (odb_core.resume, pure) and the worker wire format.

The resume properties: whatever step every rank stopped at, and whatever world
size resumes, the ids emitted before the checkpoint and after it cover the epoch
exactly once.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core.errors import ConfigError
from odb_core.resume import EpochProgress, merge, partition, seal

pytestmark = pytest.mark.torch

FP = {"dataset": "x", "protocol.budget_tokens": 64}


def progress(
    world: int,
    rank: int,
    done: set[int],
    base: frozenset[int] = frozenset(),
    emitted: int = 9,
) -> EpochProgress:
    return EpochProgress(FP, 1, 5, emitted, False, base, world, rank, frozenset(done))


@given(st.integers(0, 60), st.integers(1, 5))
def test_partition_puts_every_id_on_exactly_one_rank(n: int, world: int) -> None:
    order = list(range(n))
    shards = [partition(order, world, r) for r in range(world)]
    assert sorted(i for s in shards for i in s) == order
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@settings(max_examples=200, deadline=None)
@given(
    st.permutations(list(range(40))),
    st.integers(1, 4),
    st.integers(1, 5),
    st.lists(st.integers(0, 40), min_size=5, max_size=5),
    st.lists(st.integers(0, 40), min_size=5, max_size=5),
)
def test_two_resumes_at_other_world_sizes_cover_exactly_once(
    order: list[int], w1: int, w2: int, cut1: list[int], cut2: list[int]
) -> None:
    # Incarnation 1 at w1: each rank emitted a prefix of its shard.
    shards1 = [partition(order, w1, r) for r in range(w1)]
    done1 = [set(shards1[r][: cut1[r]]) for r in range(w1)]
    n1 = sum(map(len, done1))  # the global count emitted, which merge checks
    g = merge(progress(w1, r, done1[r], emitted=n1) for r in range(w1))
    assert g.is_global
    # Incarnation 2 at w2 from the merged state; again stop somewhere.
    shards2 = [g.shard(order, w2, r) for r in range(w2)]
    done2 = [set(shards2[r][: cut2[r]]) for r in range(w2)]
    # Local resume of incarnation 2 on the same ranks.
    locals_ = [progress(w2, r, done2[r], g.base_done) for r in range(w2)]
    shards3 = [locals_[r].shard(order, w2, r) for r in range(w2)]
    emitted = [i for d in done1 for i in d] + [i for d in done2 for i in d]
    emitted += [i for s in shards3 for i in s]
    assert sorted(emitted) == sorted(order)


def test_round_trip_is_plain_data() -> None:
    p = replace(progress(2, 1, {3, 1, 2}, frozenset({9})), start_emitted=1)
    d = p.to_dict()
    assert d["done"] == [[1, 4]] and d["base_done"] == [[9, 10]]
    assert EpochProgress.from_dict(d) == p
    q = replace(p, window=4, start_step=2, start_emitted=5, start_window=1)
    d = q.to_dict()
    assert (d["window"], d["start_step"], d["start_emitted"], d["start_window"]) == (4, 2, 5, 1)
    assert EpochProgress.from_dict(d) == q


def test_merged_state_starts_a_new_protocol_run_at_the_saved_step() -> None:
    parts = [
        replace(
            progress(2, r, {r}, emitted=2), window=3, start_step=1, start_emitted=2, start_window=1
        )
        for r in range(2)
    ]
    g = merge(parts)
    assert (g.start_step, g.start_emitted, g.start_window, g.window) == (5, 2, 3, 3)
    with pytest.raises(ConfigError, match=r"window=4.*same step"):
        merge([parts[0], replace(parts[1], window=4)])


def test_an_older_state_version_is_refused_naming_it() -> None:
    d = progress(2, 0, {1}).to_dict()
    old = {k: v for k, v in d.items() if "window" not in k and not k.startswith("start_")}
    for version in (1, 2):
        with pytest.raises(
            ConfigError, match=rf"version {version}, expected 4: it was saved by an older"
        ):
            EpochProgress.from_dict({**old, "version": version})


def test_a_local_state_refuses_another_rank_or_world() -> None:
    p = progress(2, 1, {1})
    with pytest.raises(ConfigError, match=r"rank 1 of world size 2.*rank 0 of world size 3"):
        p.excluded(3, 0)


@pytest.mark.parametrize(
    ("states", "needle"),
    [
        ([], "got none"),
        ([progress(2, 0, {1})], r"ranks \[0\]"),
        ([progress(2, 0, {1}), progress(2, 0, {2})], r"ranks \[0, 0\]"),
        ([progress(2, 0, {1}), progress(2, 1, {1})], "done on two ranks"),
    ],
)
def test_merge_rejects_inconsistent_states(states: list[EpochProgress], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        merge(states)


def test_merge_rejects_states_from_different_steps() -> None:
    a = progress(2, 0, {1})
    b = EpochProgress(FP, 1, 6, 9, False, frozenset(), 2, 1, frozenset({2}))
    with pytest.raises(ConfigError, match=r"step=6.*same step"):
        merge([a, b])


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ({"format": "nope"}, "not an ODBDataLoader state"),
        ({"version": 99}, "version 99"),
        ({"step": -1}, "step=-1"),
        ({"start_step": -2}, "start_step=-2"),
        ({"window": "x"}, "window='x'"),
        ({"done": ["a"]}, r"done\[0\]='a' is not a \[start, stop\] pair"),
    ],
)
def test_from_dict_names_the_bad_field(bad: dict[str, object], needle: str) -> None:
    d = seal({**progress(2, 0, {1}).to_dict(), **bad})  # past the checksum, to the field
    with pytest.raises(ConfigError, match=needle):
        EpochProgress.from_dict(d)


def test_wire_round_trip_keeps_tensors_equal() -> None:
    torch = pytest.importorskip("torch")
    from odb_core.torch.wire import SMALL_TENSOR_BYTES, pack, unpack

    big = torch.arange(SMALL_TENSOR_BYTES // 4 + 10, dtype=torch.float32)
    records = [
        (0, {"input_ids": torch.arange(7), "x": torch.ones(2, 3).t(), "empty": torch.zeros(0)}),
        (1, {"bf16": torch.ones(4, dtype=torch.bfloat16), "big": big, "list": [1, 2]}),
    ]
    packed = pack(records)
    assert len(packed.large) == 1 and packed.large[0] is big
    out = unpack(packed)
    for (i, a), (j, b) in zip(records, out, strict=True):
        assert i == j and a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
            else:
                assert a[k] == b[k]
