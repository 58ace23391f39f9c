"""The explicit-state checker: guarantees hold, bounds are reached, bugs are caught."""

from __future__ import annotations

import pytest

from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import Budget, PaddedTokens
from odb_core.formers import FormerKind
from odb_core.verify.bugs import BugVariant
from odb_core.verify.checker import PROPERTIES, check
from odb_core.verify.fairness import check_variant
from odb_core.verify.model import ModelConfig, round_robin_shards


def model(world: int, n: int, k: int, mode: Mode = Mode.JOIN, **kw: object) -> ModelConfig:
    costs = kw.pop("costs", [(i % 3) + 1 for i in range(n)])
    protocol = ProtocolConfig(
        world_size=world,
        budget=Budget(kw.pop("budget", 4)),  # type: ignore[arg-type]
        buffer_size=k,
        mode=mode,
        max_steps_per_round=kw.pop("m", 2),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    return ModelConfig(protocol, round_robin_shards(costs, world))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize(
    ("world", "n", "k"), [(1, 4, 2), (2, 5, 1), (2, 6, 2), (3, 6, 1), (3, 7, 2), (3, 8, 3)]
)
def test_all_guarantees_hold(mode: Mode, world: int, n: int, k: int) -> None:
    r = check(model(world, n, k, mode))
    assert r.complete and r.ok, [v.to_json() for v in r.violations]
    assert r.deadlocks == 0 and r.acyclic
    assert r.terminal_states >= 1
    assert r.max_steps_seen <= r.steps_bound
    assert r.max_rounds_seen <= r.rounds_bound


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize(
    "window", [{"grad_accum_steps": 2}, {"grad_accum_steps": 3}, {"tokens_per_update": 3}]
)
def test_windows_and_masked_loss_tokens_keep_every_guarantee(
    mode: Mode, window: dict[str, int]
) -> None:
    costs = [(i % 3) + 1 for i in range(7)]
    protocol = ProtocolConfig(
        world_size=3, budget=Budget(4), buffer_size=2, mode=mode, max_steps_per_round=2, **window
    )
    loss = [c - 1 for c in costs]  # a masked first token per sample
    r = check(ModelConfig(protocol, round_robin_shards(costs, 3, loss)))
    assert r.complete and r.ok, [v.to_json() for v in r.violations]
    assert r.deadlocks == 0 and r.acyclic


def test_thousands_of_states_on_the_reference_config() -> None:
    for mode in Mode:
        r = check(model(3, 6, 1, mode))
        assert r.ok and r.states >= 1000


@pytest.mark.parametrize("former", list(FormerKind))
def test_other_formers_and_padded_cost(former: FormerKind) -> None:
    protocol = ProtocolConfig(
        world_size=2,
        budget=Budget(6),
        buffer_size=3,
        former=former,
        cost_model=PaddedTokens(),
        max_steps_per_round=2,
    )
    r = check(ModelConfig(protocol, round_robin_shards([1, 3, 2, 2, 3, 1, 1], 2)))
    assert r.ok, [v.to_json() for v in r.violations]


def test_quota_closes_at_exact_step() -> None:
    r = check(model(2, 8, 2, Mode.QUOTA, quota=3))
    assert r.ok, [v.to_json() for v in r.violations]


def test_deterministic_mode_has_one_arrival_order() -> None:
    free = check(model(2, 6, 2))
    det = check(model(2, 6, 2, deterministic=True))
    assert det.ok and det.states < free.states


def test_bounds_are_reached() -> None:
    # Every sample costs the whole budget, so each is its own batch and the
    # rank with the most samples sets the step count: the step bound is tight.
    # A rank whose last batch is offered before it sees its source run dry
    # needs one more, empty, round: the round bound is tight as well.
    r = check(model(2, 5, 1, costs=[4] * 5))
    assert r.ok
    assert r.max_steps_seen == r.steps_bound == 3
    assert r.max_rounds_seen == r.rounds_bound == 4


@pytest.mark.parametrize("bug", list(BugVariant), ids=lambda b: b.value)
def test_every_broken_variant_is_caught(bug: BugVariant) -> None:
    r = check_variant(bug)
    assert bug.violates in r.violated()
    v = next(v for v in r.violations if v.property == bug.violates)
    assert v.trace, "a counterexample comes with a trace of actions"
    assert all("(" in label or label == "AllGather" for label in v.trace)


@pytest.mark.parametrize("bug", list(BugVariant), ids=lambda b: b.value)
def test_the_correct_machine_passes_each_bug_model(bug: BugVariant) -> None:
    from dataclasses import replace

    from odb_core.protocol import RankMachine

    r = check(replace(bug.model(), machine=RankMachine))
    assert r.ok, [v.to_json() for v in r.violations]


def test_unknown_property_is_rejected() -> None:
    with pytest.raises(ValueError, match="NoSuchThing"):
        check(model(1, 2, 1), properties=["NoSuchThing"])
    assert "DeadlockFreedom" in PROPERTIES


def test_quota_mode_has_the_tighter_bound_and_reaches_it() -> None:
    """Quota mode never pads, so steps <= min_r N_r (and rounds <= min_r N_r + 1);
    BoundedTermination checks that bound there, and a model reaches it."""
    r = check(model(2, 5, 1, Mode.QUOTA, costs=[4] * 5))
    assert r.ok
    assert (r.steps_bound, r.rounds_bound) == (2, 3)
    assert r.max_steps_seen == r.steps_bound
    assert r.max_rounds_seen <= r.rounds_bound
    join = check(model(2, 5, 1, costs=[4] * 5))
    assert join.steps_bound == 3 > r.max_steps_seen
