"""Quota-mode carry-over (odb_core.ledger): pure properties over random plans."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core.errors import ConfigError
from odb_core.ledger import ledger_ids, plan_epoch, rank_order, share, validate_ledgers
from odb_core.resume import EpochProgress, merge, partition, seal


@st.composite
def epochs(draw: st.DrawFn) -> tuple[int, list[list[int]], list[list[int]], bool]:
    """(world, per-rank partition, per-rank ledger of the previous epoch, keep_on_rank)."""
    world = draw(st.integers(1, 5))
    n = draw(st.integers(0, 40))
    order = draw(st.permutations(list(range(n))))
    carried = draw(st.lists(st.sampled_from(order), unique=True)) if n else []
    keep = draw(st.booleans())
    ledgers: list[list[int]] = [[] for _ in range(world)]
    for i in carried:
        ledgers[draw(st.integers(0, world - 1))].append(i)
    return world, [partition(order, world, r) for r in range(world)], ledgers, keep


@given(epochs())
def test_every_id_at_most_once_and_nothing_dropped(
    case: tuple[int, list[list[int]], list[list[int]], bool],
) -> None:
    _, parts, ledgers, keep = case
    orders = plan_epoch(ledgers, parts, keep_on_rank=keep)
    flat = [i for o in orders for i in o]
    assert len(flat) == len(set(flat))
    assert set(flat) == {i for p in parts for i in p} | {i for lg in ledgers for i in lg}


@given(epochs())
def test_ledgered_ids_come_first_on_their_rank(
    case: tuple[int, list[list[int]], list[list[int]], bool],
) -> None:
    world, parts, ledgers, keep = case
    orders = plan_epoch(ledgers, parts, keep_on_rank=keep)
    carried = set(ledger_ids(validate_ledgers(ledgers)))
    for r, order in enumerate(orders):
        head = share(validate_ledgers(ledgers), world, r, keep_on_rank=keep)
        assert order[: len(head)] == head
        assert not carried & set(order[len(head) :])
        if keep:
            assert head == ledgers[r]
    # Balanced when the ledger may move: shares differ by at most one.
    if not keep:
        sizes = [len(share(validate_ledgers(ledgers), world, r)) for r in range(world)]
        assert max(sizes) - min(sizes) <= 1


@settings(max_examples=60)
@given(
    st.integers(1, 4),
    st.integers(0, 40),
    st.integers(1, 5),
    st.randoms(use_true_random=False),
)
def test_union_over_epochs_covers_every_id(
    world: int, n: int, n_epochs: int, rnd: random.Random
) -> None:
    """Each rank emits an arbitrary part of its order, always including its carried
    share (as a quota close does when the epoch runs past the window): whatever an
    epoch does not emit is carried and emitted by the next one."""
    ledgers: list[list[int]] = [[] for _ in range(world)]
    seen: set[int] = set()
    for _ in range(n_epochs):
        order = rnd.sample(range(n), n)
        carried_in = {i for lg in ledgers for i in lg}
        orders = plan_epoch(ledgers, [partition(order, world, r) for r in range(world)])
        emitted: list[int] = []
        ledgers = []
        for o in orders:
            k = len(set(o) & carried_in)
            cut = rnd.randint(k, len(o))
            emitted.extend(o[:cut])
            ledgers.append(o[cut:])
        assert len(emitted) == len(set(emitted))
        assert carried_in <= set(emitted)
        assert set(emitted) | {i for lg in ledgers for i in lg} == set(range(n))
        seen |= set(emitted)
    assert seen | {i for lg in ledgers for i in lg} == set(range(n))


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: validate_ledgers([[1, "x"]]), "'x'"),
        (lambda: validate_ledgers([[1, True]]), "True"),
        (lambda: validate_ledgers([[1.5]]), "1.5"),
        (lambda: validate_ledgers("12"), "'12'"),
        (lambda: validate_ledgers([[3], [4, 3]]), "3"),
        (lambda: validate_ledgers([[7, 7]]), "7"),
        (lambda: plan_epoch([[]], [[1, 2], [2]]), "2"),
        (lambda: plan_epoch([[]], [[5, 5]]), "5"),
        (lambda: rank_order([[1]], [2], 2, 9), "rank=9"),
        (lambda: share(((1,),), 0, 0), "world=0"),
        (lambda: share(((1,), (2,)), 3, 0, keep_on_rank=True), "3 ranks"),
    ],
)
def test_bad_input_raises_naming_the_value(call: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        call()


def _progress(carry: Any, **kw: Any) -> EpochProgress:
    base: dict[str, Any] = dict(
        fingerprint={"k": 1}, epoch=2, step=3, emitted=4, closed=False, base_done=frozenset()
    )
    base.update(kw)
    return EpochProgress(carry=carry, **base)


def test_progress_keeps_the_carry_as_plain_data() -> None:
    p = _progress(((4, 2), (9,)), world_size=2, rank=0, done=frozenset({4}))
    d = p.to_dict()
    assert d["carry"] == [[4, 2], [9]]
    assert EpochProgress.from_dict(d) == p
    # A state without its carry would silently drop the carried ids: refused.
    with pytest.raises(ConfigError, match="'carry'"):
        EpochProgress.from_dict({k: v for k, v in d.items() if k != "carry"})
    with pytest.raises(ConfigError, match="'x'"):
        EpochProgress.from_dict(seal({**d, "carry": [["x"]]}))


def test_merge_needs_the_same_carry_on_every_rank() -> None:
    a = _progress(((1,), (2,)), world_size=2, rank=0, done=frozenset({5, 6}))
    b = _progress(((1,), (2,)), world_size=2, rank=1, done=frozenset({7, 8}))
    assert merge([a, b]).carry == ((1,), (2,))
    with pytest.raises(ConfigError, match="carry"):
        merge([a, _progress(((1,), ()), world_size=2, rank=1, done=frozenset({7, 8}))])
