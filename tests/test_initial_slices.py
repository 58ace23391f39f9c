"""The initial slices of dynamic sharding (`assign.initial_slices`): without a table
the equal-count shares, bit for bit; with a learned cost table, consecutive slices
of about equal priced cost, the whole plan when one round would deal all the rest,
and the same on every rank (issue 32)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core.assign import dynamic_bounds, initial_cursor, initial_slice, initial_slices
from odb_core.config import Mode, ProtocolConfig, Sharding
from odb_core.cost import Budget
from odb_core.cost_table import CostTable, record
from odb_core.protocol import RankMachine, initial_slices_of
from odb_core.verify.checker import check
from odb_core.verify.model import dynamic_model


def assert_partition(slices: Sequence[tuple[int, int]], cursor: int, world: int) -> None:
    """One slice a rank, consecutive and contiguous, covering [0, cursor) once, and
    at least one id a rank while there is one a rank."""
    assert len(slices) == world
    at = 0
    for start, stop in slices:
        assert start == at and start <= stop, slices
        if cursor >= world:
            assert stop > start, slices
        at = stop
    assert at == cursor, slices


def test_the_partition_check_catches_an_overlap_a_skip_and_a_missing_rank() -> None:
    assert_partition(((0, 2), (2, 3)), 3, 2)
    for broken in (((0, 2), (1, 3)), ((0, 1), (2, 3)), ((0, 3), (3, 3)), ((0, 3),)):
        with pytest.raises(AssertionError):
            assert_partition(broken, 3, 2)


def test_without_a_table_the_slices_are_the_equal_count_shares() -> None:
    for n in (0, 1, 3, 7, 64, 1000, 20_000):
        for w in (1, 2, 3, 8, 1024):
            for t in (1, 2, 32, 64):
                slices = initial_slices(n, w, t)
                assert slices == tuple(initial_slice(r, n, w, t) for r in range(w))
                assert_partition(slices, initial_cursor(n, w, t), w)


def _priced(costs: Sequence[int | None]) -> Callable[[int], int]:
    """The table's priced prefix of a plan 0..n-1 whose id i cost costs[i] (None:
    never seen, priced at the mean)."""
    seen = {i: c for i, c in enumerate(costs) if c is not None}
    return CostTable(record(seen, len(costs))).priced_prefix(tuple(range(len(costs))))


@settings(max_examples=300, deadline=None)
@given(
    costs=st.lists(st.one_of(st.none(), st.integers(0, 5000)), min_size=0, max_size=300),
    world=st.integers(1, 40),
    target=st.integers(1, 64),
)
def test_priced_slices_split_the_prefix_by_priced_cost(
    costs: list[int | None], world: int, target: int
) -> None:
    n = len(costs)
    priced = _priced(costs)
    slices = initial_slices(n, world, target, priced)
    cursor = initial_cursor(n, world, target, priced=True)
    assert_partition(slices, cursor, world)
    # The same ids as today's shares, or (when a round would deal the rest anyway)
    # the whole plan; the rounds bound counts what is dealt up front.
    assert cursor == (n if world * target >= n else initial_cursor(n, world, target))
    assert dynamic_bounds(n, world, target, True)[1] == n + (n - cursor) + 1
    # Every rank's priced cost is within two ids' prices of the even split.
    dear = max((priced(k + 1) - priced(k) for k in range(cursor)), default=0)
    for start, stop in slices:
        assert priced(stop) - priced(start) <= priced(cursor) // world + 2 * dear + 1


def test_priced_slices_even_out_dear_ids() -> None:
    # Four ranks, 16 ids: the first eight cost 100, the rest 1. Equal counts would
    # give ranks 0 and 1 all the dear ids; priced, each rank starts on about a
    # quarter of the priced work (the table prices 100 at 101, its code's cost).
    costs = [100] * 8 + [1] * 8
    priced = _priced(costs)
    assert initial_slices(16, 4, 8) == ((0, 2), (2, 4), (4, 6), (6, 8))
    slices = initial_slices(16, 4, 4, priced)  # 4 x 4 >= 16: the whole plan
    assert slices[-1][1] == 16
    work = [priced(b) - priced(a) for a, b in slices]
    assert work == [202, 202, 202, 210]


def _config(costs: Sequence[int], world: int, window: int) -> ProtocolConfig:
    return ProtocolConfig(
        world_size=world,
        budget=Budget(4),
        buffer_size=window,
        max_steps_per_round=2,
        mode=Mode.JOIN,
        sharding=Sharding.DYNAMIC,
        assign_target=window,
        plan=tuple(range(len(costs))),
        cost_table=CostTable(record(dict(enumerate(costs)), len(costs))),
    )


def test_every_rank_starts_on_its_slice_of_one_agreed_split() -> None:
    costs = [1, 9, 1, 1, 9, 9, 1, 1, 2, 1, 1, 1]
    for window in (2, 3, 8):
        cfg = _config(costs, 3, window)
        machines = [RankMachine(r, cfg) for r in range(3)]
        slices = initial_slices_of(cfg)
        assert_partition(slices, machines[0].cursor, 3)
        assert {m.cursor for m in machines} == {slices[-1][1]}
        assert {m.snapshot().slices for m in machines} == {tuple((s,) for s in slices)}
        for m, (a, b) in zip(machines, slices, strict=True):
            assert list(m.queue) == list(cfg.plan[a:b])


class RankLocalInitialSlices(RankMachine):
    """Broken: each rank splits the initial prefix by prices of its own (rank 0 by
    the ids' count, the others by their squares), so the ranks' slices are not one
    split of the prefix: some id is loaded twice or by no rank."""

    def __init__(self, rank: int, config: ProtocolConfig) -> None:
        super().__init__(rank, config)
        n, w = len(config.plan), config.world_size
        own = initial_slices(n, w, config.target, lambda k: k * (1 + rank * k))
        start, stop = own[rank]
        self.queue = dict.fromkeys(config.plan[start:stop])


def test_initial_slices_from_anything_but_agreed_state_are_caught() -> None:
    # 8 ids on 2 ranks, window 3: the target is 2 and the priced prefix half the plan.
    costs = (1, 3, 1, 1, 3, 1, 2, 1)
    cfg = _config(costs, 2, 3)
    assert initial_cursor(8, 2, cfg.target, priced=True) == 4
    assert check(dynamic_model(cfg, costs)).ok
    r = check(dynamic_model(cfg, costs, machine=RankLocalInitialSlices))
    assert not r.ok and {"NoLoss", "NoDuplicate"} & {v.property for v in r.violations}


def test_a_plan_dealt_whole_up_front_keeps_exactly_once_and_the_bound() -> None:
    # 4 ids on 2 ranks, window 3: the target is 2 and 2 x 2 >= 4, so the table deals
    # all of them up front (without it, one id a rank).
    costs = (3, 1, 1, 2)
    cfg = _config(costs, 2, 3)
    assert initial_cursor(4, 2, cfg.target) == 2
    assert initial_cursor(4, 2, cfg.target, priced=True) == 4
    r = check(dynamic_model(cfg, costs))
    assert r.ok, [v.to_json() for v in r.violations]
