"""Adversarial pricing (issue 32): a deal's count is decided from the gathered vectors
alone, and where its ids go, whatever a cost table says, never touches safety.

`ModelConfig.any_placement` (the spec's `AnyPlacement`): every round's deal is split
by any placement of its count, agreed by every rank at `AllGather`; the checker and
TLC (the `MCplacement_*` models of spec/manifest.json, whose graphs
tests/test_conformance.py shows equal) find exactly-once, alignment and the bounds
intact. `rank-local-placement` (each rank its own split) is caught
(tests/test_checker.py, tests/test_tlc.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from odb_core.collective import decide_round
from odb_core.config import Mode, ProtocolConfig, Sharding
from odb_core.cost import Budget
from odb_core.cost_table import CostTable, record
from odb_core.errors import ConfigError
from odb_core.protocol import RankMachine
from odb_core.verify import tlc
from odb_core.verify.bugs import BugVariant
from odb_core.verify.checker import check
from odb_core.verify.model import (
    Action,
    GlobalModel,
    GlobalState,
    ModelConfig,
    dynamic_model,
    round_robin_shards,
    splits,
)

PLACED = [m for m in tlc.load_manifest() if m.any_placement]


def _dynamic(
    world: int, costs: tuple[int, ...], mode: Mode = Mode.JOIN, **kw: object
) -> ModelConfig:
    p = ProtocolConfig(
        world_size=world,
        budget=Budget(4),
        buffer_size=2,
        max_steps_per_round=2,
        mode=mode,
        sharding=Sharding.DYNAMIC,
        assign_target=2,
        **kw,  # type: ignore[arg-type]
    )
    return replace(dynamic_model(p, costs), any_placement=True)


def _graph(cfg: ModelConfig) -> list[tuple[GlobalState, Action, GlobalState]]:
    model = GlobalModel(cfg)
    inits = model.inits()
    seen, stack, out = set(inits), list(inits), []
    while stack:
        s = stack.pop()
        for a, t in model.successors(s):
            out.append((s, a, t))
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return out


def test_splits_are_every_placement_of_the_count() -> None:
    assert splits(0, 3) == ((0, 0, 0),)
    assert splits(2, 2) == ((0, 2), (1, 1), (2, 0))
    assert len(splits(3, 3)) == 10 and all(sum(a) == 3 for a in splits(3, 3))
    assert Action("AllGather", deal=(1, 0)).label == "AllGather(1,0)"


def test_any_placement_is_for_dynamic_sharding_without_a_table() -> None:
    static = ProtocolConfig(world_size=2, budget=Budget(4), buffer_size=1)
    with pytest.raises(ConfigError, match="dynamic"):
        ModelConfig(static, round_robin_shards([1, 2], 2), any_placement=True)
    table = CostTable(record({0: 1, 1: 2, 2: 3}, 3))
    with pytest.raises(ConfigError, match="table"):
        _dynamic(2, (1, 2, 3), cost_table=table)


def test_placement_models_cover_both_modes_and_world_sizes() -> None:
    assert {m.mode for m in PLACED} == {"join", "quota"}
    assert {m.world_size for m in PLACED} == {2, 3}
    assert all(m.conformance and m.sharding == "dynamic" for m in PLACED)
    assert all(
        tlc.spec_constants(m.model_config()).scalars["AnyPlacement"] == "TRUE" for m in PLACED
    )


@pytest.mark.parametrize("name", [m.name for m in PLACED])
def test_placement_models_reach_every_split_and_contain_the_mean_priced_model(name: str) -> None:
    """Every AllGather branches over all splits of the count `assign.deal` decides
    (the count never changes); some split is not the mean-priced one, some gives a
    starved rank no id; and every state of the mean-priced model is reached."""
    cfg = next(m for m in PLACED if m.name == name).model_config()
    p = cfg.protocol
    edges = _graph(cfg)
    other = starved = starved_skipped = False
    by_source: dict[GlobalState, set[tuple[int, ...]]] = {}
    for s, a, t in edges:
        if a.name != "AllGather":
            assert t.placement is None or t.placement == s.placement
            continue
        assert a.deal is not None and t.placement == a.deal
        gathered = t.inbox[0]
        assert gathered is not None
        rs = s.ranks[0]
        d = decide_round(
            p.mode,
            p.quota,
            rs.emitted,
            gathered,
            plan_left=len(p.plan) - rs.cursor,
            target=p.target,
        )
        assert sum(a.deal) == sum(d.assigned)
        by_source.setdefault(s, set()).add(a.deal)
        other |= bool(d.assigned) and a.deal != d.assigned
        hungry = [r for r, c in enumerate(gathered) if c.offered == 0 and not c.final]
        starved |= bool(hungry)
        starved_skipped |= any(a.deal[r] == 0 for r in hungry)
    for deals in by_source.values():
        assert deals == set(splits(sum(next(iter(deals))), p.world_size))
    assert other
    # A starved rank's first id is the mean-priced deal's rule, not a placement's.
    # (Window 1, MCplacement_w3_n6_k1: a rank forms what it reads, never offers 0.)
    assert starved_skipped == starved == (name != "MCplacement_w3_n6_k1")
    placed = {t._replace(placement=None) for _, _, t in edges}
    mean = {t for _, _, t in _graph(replace(cfg, any_placement=False))}
    assert mean <= placed and len(mean) < len(placed)


@pytest.mark.parametrize(
    ("world", "costs", "mode", "quota"),
    [
        (2, (3, 1, 1, 1, 1, 2, 1), Mode.JOIN, None),
        (3, (1, 2, 3, 1, 2, 3), Mode.JOIN, None),
        (2, (3, 1, 1, 1, 2, 1), Mode.QUOTA, 3),
    ],
)
def test_checker_passes_any_placement_beyond_the_tlc_models(
    world: int, costs: tuple[int, ...], mode: Mode, quota: int | None
) -> None:
    r = check(_dynamic(world, costs, mode, quota=quota))
    assert r.ok, [v.to_json() for v in r.violations]
    assert r.max_steps_seen <= r.steps_bound and r.max_rounds_seen <= r.rounds_bound


def test_a_rank_local_placement_changes_the_ids_dealt() -> None:
    """Each rank its own split (here: all of the deal to itself): the count is the
    deal's, but two ranks load one id; the same model with agreed placements holds."""
    bug = BugVariant.RANK_LOCAL_PLACEMENT
    assert bug.dynamic and bug.violates == "NoDuplicate"
    r = check(bug.model(), properties=["NoDuplicate", "NoLoss"])
    assert {"NoDuplicate", "NoLoss"} & r.violated()
    assert check(replace(bug.model(), machine=RankMachine, any_placement=True)).ok
