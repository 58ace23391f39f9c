"""Dynamic sharding (`Sharding.DYNAMIC`): the pure deal of `odb_core.assign`, the
rank machine's source semantics, and the checker on models that reach a deal."""

from __future__ import annotations

import pytest

from odb_core.assign import (
    deal,
    deal_target,
    dynamic_bounds,
    initial_cursor,
    initial_share,
    initial_slice,
)
from odb_core.collective import Contribution
from odb_core.config import Mode, ProtocolConfig, Sharding
from odb_core.cost import Budget
from odb_core.errors import ConfigError, ODBPeerError, ProtocolError
from odb_core.protocol import RankAction, RankMachine
from odb_core.sample import Sample
from odb_core.verify.checker import check
from odb_core.verify.model import GlobalModel, dynamic_model


def _c(offered: int = 0, unread: int = 0, held: int = 0, work: int = 0) -> Contribution:
    return Contribution(
        offered, False, (1,) * offered, (4,) * offered, (1,) * offered, unread, held, work
    )


def test_deal_goes_to_the_rank_holding_the_least_work() -> None:
    # Rank 0 holds 2 samples of 40 tokens, rank 1 two of 4: the mean is 11 tokens,
    # so rank 1 gets ids until its estimate passes rank 0's.
    got = deal([_c(held=2, work=80), _c(held=2, work=8)], steps=0, plan_left=10, target=6)
    assert sum(got) == 8 and got[1] > got[0]
    assert got == deal([_c(held=2, work=80), _c(held=2, work=8)], 0, 10, 6)  # pure


def test_deal_tops_up_to_the_target_and_never_past_the_plan() -> None:
    assert deal([_c(held=1, work=1), _c(held=3, work=3)], 0, 100, 4) == (3, 1)
    assert sum(deal([_c(), _c(), _c()], 0, 2, 4)) == 2
    assert deal([_c(offered=1, held=5, work=5)], 0, 9, 4) == (0,)
    # A starved rank (offered nothing, not final) gets an id even above the target.
    assert deal([_c(held=5, work=5)], 0, 9, 4) == (1,)
    assert deal([_c(held=5, work=5)._replace(final=True)], 0, 9, 4) == (0,)
    # Batches offered beyond the agreed steps stay held and count.
    assert deal([_c(offered=2), _c(offered=2)], 1, 9, 2) == (1, 1)
    assert deal([_c(offered=2), _c(offered=2)], 2, 9, 2) == (2, 2)


def test_initial_shares_leave_half_of_the_plan_to_the_deal() -> None:
    assert initial_share(20_000, 64, 64) == 64
    assert initial_share(20_000, 1024, 64) == 9
    assert initial_share(3, 4, 64) == 1
    assert [initial_slice(r, 3, 4, 64) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert initial_cursor(3, 4, 64) == 3
    assert dynamic_bounds(10, 2, 2) == (10, 10 + 6 + 1)


def test_the_deal_target_is_the_half_split_between_half_the_window_and_the_window() -> None:
    # 20,000 ids, window 64: the half split (156, 39, 9 at 64, 256, 1,024 ranks)
    # bounds the target, which never falls under half a window.
    assert [deal_target(20_000, w, 64) for w in (8, 64, 256, 512, 1024)] == [64, 64, 39, 32, 32]
    assert deal_target(3000, 32, 64) == 46
    assert deal_target(7, 2, 2) == 1 and deal_target(6, 2, 3) == 2 and deal_target(6, 3, 1) == 1
    for n in range(1, 200, 7):
        for w in (1, 2, 3, 8, 64):
            for t in (1, 2, 3, 8, 64):
                d = deal_target(n, w, t)
                assert -(-t // 2) <= d <= t
                # The initial share is the one the configured target gives.
                assert initial_share(n, w, d) == initial_share(n, w, t) <= d
    dyn = ProtocolConfig(
        world_size=32,
        budget=Budget(4),
        buffer_size=64,
        sharding=Sharding.DYNAMIC,
        plan=tuple(range(3000)),
    )
    assert dyn.configured_target == 64 and dyn.target == 46
    static = ProtocolConfig(world_size=32, budget=Budget(4), buffer_size=64)
    assert static.target == static.configured_target == 64


def _dynamic(world: int = 2, n: int = 6, **kw: object) -> ProtocolConfig:
    return ProtocolConfig(
        world_size=world,
        budget=Budget(4),
        buffer_size=2,
        sharding=Sharding.DYNAMIC,
        plan=tuple(range(n)),
        **kw,
    )  # type: ignore[arg-type]


def test_config_validates_the_plan() -> None:
    with pytest.raises(ConfigError, match="only meaningful"):
        ProtocolConfig(world_size=1, budget=Budget(4), plan=(0,))
    with pytest.raises(ConfigError, match="twice"):
        _dynamic().__class__(world_size=1, budget=Budget(4), sharding="dynamic", plan=(1, 1))
    with pytest.raises(ConfigError, match="unknown sharding"):
        ProtocolConfig(world_size=1, budget=Budget(4), sharding="round-robin")
    assert "sharding" not in ProtocolConfig(world_size=1, budget=Budget(4)).describe()
    assert _dynamic().describe()["sharding"] == "dynamic"


def test_a_rank_loads_only_what_it_was_dealt() -> None:
    m = RankMachine(1, _dynamic())  # initial share 1: rank 1 holds plan id 1
    assert list(m.queue) == [1] and m.plan_left == 4
    with pytest.raises(ProtocolError, match="not assigned"):
        m.observe(Sample(0, 1))
    m.observe(Sample(1, 1))
    # Nothing unread but the plan is not dealt out: starved, not dry.
    assert m.starved and RankAction.EXHAUST not in m.enabled()
    with pytest.raises(ProtocolError):
        m.exhaust()
    m.form()
    c = m.contribute()
    assert not c.final and c.unread == 0
    other = RankMachine(0, _dynamic())
    other.observe(Sample(0, 3))
    c0 = other.fill(lambda: None)
    res = m.all_gather([c0, c])
    # Both ranks are starved and hold an open batch back: a round without steps,
    # which deals each of them the next id (rank 1's after rank 0's).
    assert res.steps == () and not res.done and c0.offered == 0
    assert m.cursor == 4 and m.plan_left == 2 and list(m.queue) == [3]
    assert RankAction.OBSERVE in m.enabled()


def test_the_vector_round_trips_with_the_held_fields() -> None:
    c = Contribution(1, False, (2,), (5,), (3,), 4, 6, 30)
    v = c.to_vector(2, dynamic=True)
    assert len(v) == Contribution.vector_length(2, dynamic=True) == 11
    assert Contribution.from_vector(v, 2, dynamic=True) == c
    with pytest.raises(ODBPeerError):
        Contribution.from_vector(v, 2)
    assert Contribution.from_vector(c.to_vector(2), 2) == c._replace(unread=0, held=0, held_work=0)


@pytest.mark.parametrize(
    ("costs", "world", "mode", "quota"),
    [
        ((3, 1, 1, 1, 1), 2, Mode.JOIN, None),  # rank 0's first sample is 3x dearer
        ((1, 2, 3, 1, 2, 3), 3, Mode.JOIN, None),
        ((3, 1, 1, 1, 2), 2, Mode.QUOTA, 3),
        ((3, 1, 1, 1, 2), 2, Mode.QUOTA, None),
    ],
)
def test_checker_passes_dynamic_models(
    costs: tuple[int, ...], world: int, mode: Mode, quota: int | None
) -> None:
    p = ProtocolConfig(
        world_size=world,
        budget=Budget(4),
        buffer_size=2,
        max_steps_per_round=2,
        mode=mode,
        quota=quota,
        sharding=Sharding.DYNAMIC,
        assign_target=2,
    )
    cfg = dynamic_model(p, costs)
    r = check(cfg)
    assert r.ok, [v.to_json() for v in r.violations]
    # The models reach what they are for: a rank starved (nothing unread) while
    # the plan still has ids that its peers' deals will take.
    model = GlobalModel(cfg)
    states, seen, stack = set(), {model.init()}, [model.init()]
    while stack:
        s = stack.pop()
        states.add(s)
        for _, t in model.successors(s):
            if t not in seen:
                seen.add(t)
                stack.append(t)
    assert any(
        rs.phase.value == "waiting" and not rs.queue and rs.cursor < len(costs)
        for s in states
        for rs in s.ranks
    )
    assert len(states) == r.states
