"""Priced initial shares (issue 32) in the model checkers: the ranks start on any agreed
split of the initial prefix, and exactly-once, alignment and the bounds hold.

`ModelConfig.any_initial_split` (the spec's `AnyInitialSplit`): the model has one
initial state per cursor of `initial_cursors` (`assign.initial_cursor` with and
without a cost table) and per split of `initial_splits` of it (any rank for each id
of the prefix, empty shares included: every placement a table can price, and every
cut into consecutive slices); the checker and TLC (the
`MCinitial_split_*` models of spec/manifest.json, whose graphs
tests/test_conformance.py shows equal) find the properties intact.
`rank-local-initial-split` (each rank its own split) is caught (tests/test_checker.py,
tests/test_tlc.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from odb_core.assign import initial_cursor
from odb_core.config import Mode, ProtocolConfig, Sharding
from odb_core.cost import Budget
from odb_core.cost_table import CostTable, record
from odb_core.errors import ConfigError
from odb_core.protocol import RankMachine
from odb_core.verify import tlc
from odb_core.verify.bugs import BugVariant
from odb_core.verify.checker import check
from odb_core.verify.model import (
    GlobalModel,
    ModelConfig,
    dynamic_model,
    initial_cursors,
    initial_splits,
    round_robin_shards,
)

SPLIT = [m for m in tlc.load_manifest() if m.any_initial_split]


def _dynamic(
    world: int, costs: tuple[int, ...], mode: Mode = Mode.JOIN, target: int = 2, **kw: object
) -> ModelConfig:
    p = ProtocolConfig(
        world_size=world,
        budget=Budget(4),
        buffer_size=2,
        max_steps_per_round=2,
        mode=mode,
        sharding=Sharding.DYNAMIC,
        assign_target=target,
        **kw,  # type: ignore[arg-type]
    )
    return replace(dynamic_model(p, costs), any_initial_split=True)


def test_initial_splits_are_every_rank_for_every_id_of_the_prefix() -> None:
    assert initial_splits(0, 2) == [()]
    assert initial_splits(2, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(initial_splits(3, 3)) == len(set(initial_splits(3, 3))) == 27  # 3^3
    assert all(len(f) == 3 and set(f) <= {0, 1, 2} for f in initial_splits(3, 3))
    # Cursors: the unpriced one, and the whole plan once W x target >= the plan.
    assert initial_cursors(6, 2, 3) == (2, 6) and initial_cursors(6, 3, 1) == (3,)


def test_any_initial_split_is_for_dynamic_sharding_without_a_table() -> None:
    static = ProtocolConfig(world_size=2, budget=Budget(4), buffer_size=1)
    with pytest.raises(ConfigError, match="dynamic"):
        ModelConfig(static, round_robin_shards([1, 2], 2), any_initial_split=True)
    table = CostTable(record({0: 1, 1: 2, 2: 3}, 3))
    with pytest.raises(ConfigError, match="table"):
        _dynamic(2, (1, 2, 3), cost_table=table)
    with pytest.raises(ValueError, match="inits"):
        GlobalModel(_dynamic(2, (1, 2, 3, 1))).init()


def test_split_models_cover_both_modes_world_sizes_and_placement() -> None:
    assert {m.mode for m in SPLIT} == {"join", "quota"}
    assert {m.world_size for m in SPLIT} == {2, 3}
    assert any(m.any_placement for m in SPLIT)
    assert all(m.conformance and m.sharding == "dynamic" for m in SPLIT)
    assert all(
        tlc.spec_constants(m.model_config()).scalars["AnyInitialSplit"] == "TRUE" for m in SPLIT
    )
    # Some model starts on the whole plan as well as on the unpriced prefix.
    assert any(len(_cursors(m.model_config())) == 2 for m in SPLIT)


def _cursors(cfg: ModelConfig) -> tuple[int, ...]:
    p = cfg.protocol
    return initial_cursors(len(p.plan), p.world_size, p.configured_target)


@pytest.mark.parametrize("name", [m.name for m in SPLIT])
def test_split_models_start_on_every_split_the_prices_can_choose(name: str) -> None:
    """One initial state per (cursor, split); the unpriced start and every split a
    cost table can place (`CostTable.placed`, here by a few tables)
    are among them; each state's slices cover the prefix once."""
    cfg = next(m for m in SPLIT if m.name == name).model_config()
    p = cfg.protocol
    n, w = len(p.plan), p.world_size
    inits = GlobalModel(cfg).inits()
    assert len(inits) == len(set(inits)) == sum(len(initial_splits(c, w)) for c in _cursors(cfg))
    starts = set()
    for s in inits:
        (c,) = {r.cursor for r in s.ranks}
        queues = [r.queue for r in s.ranks]
        assert sorted(i for q in queues for i in q) == sorted(p.plan[:c])
        assert all(list(q) == [i for i in p.plan if i in q] for q in queues)  # plan order
        assert s.pending == tuple(frozenset(q) for q in queues)
        starts.add(tuple(queues))
    unpriced = GlobalModel(replace(cfg, any_initial_split=False)).init()
    assert tuple(r.queue for r in unpriced.ranks) in starts
    # Every placement a table can price, the machines' own starts on its placed plan.
    for costs in ((1,) * n, tuple(range(n)), tuple(range(n, 0, -1)), (9, *(1,) * (n - 1))):
        table = CostTable(record(dict(enumerate(costs)), n))
        priced = replace(p, cost_table=table)
        machines = [RankMachine(r, priced) for r in range(w)]
        assert {m.cursor for m in machines} == {
            initial_cursor(n, w, p.configured_target, priced=True)
        }
        assert tuple(tuple(m.queue) for m in machines) in starts


@pytest.mark.parametrize(
    ("world", "costs", "mode", "target", "quota"),
    [
        (2, (3, 1, 1, 1, 1, 2, 1), Mode.JOIN, 2, None),
        (2, (1, 2, 3, 1, 2), Mode.JOIN, 3, None),
        (2, (3, 1, 1, 1, 2, 1), Mode.QUOTA, 5, 3),
    ],
)
def test_checker_passes_any_initial_split_beyond_the_tlc_models(
    world: int, costs: tuple[int, ...], mode: Mode, target: int, quota: int | None
) -> None:
    r = check(_dynamic(world, costs, mode, target, quota=quota))
    assert r.ok, [v.to_json() for v in r.violations]
    assert r.max_steps_seen <= r.steps_bound and r.max_rounds_seen <= r.rounds_bound


def test_a_rank_local_initial_split_loads_an_id_twice() -> None:
    """Each rank its own split of the prefix: rank 0 by squared prices, rank 1 by
    count, so their slices overlap; the same model started on agreed splits holds."""
    bug = BugVariant.RANK_LOCAL_INITIAL_SPLIT
    assert bug.dynamic and bug.violates == "NoDuplicate"
    init = GlobalModel(bug.model()).init()
    assert init.pending[0] & init.pending[1]
    r = check(bug.model(), properties=["NoDuplicate"])
    assert "NoDuplicate" in r.violated()
    assert check(replace(bug.model(), machine=RankMachine, any_initial_split=True)).ok
