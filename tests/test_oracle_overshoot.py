"""The bounded oracles are exact: a state at the bound passes, one just past it fails.

Every broken rank machine of bugs.py overshoots its bound by more than one, so an
oracle loosened by one (`>` -> `>=` + 1, `> 1` -> `> 2`) would still catch them.
These states overshoot by exactly one step, one round, or one extra collective of
skew, starting from reachable states of the bounds witness model, where the bounds
are tight. They are the fixed mutation regression of `make test` (docs/VERIFICATION.md).
"""

from __future__ import annotations

from collections import deque

import pytest

from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import Budget
from odb_core.protocol import RankSnapshot, rounds_bound, steps_bound
from odb_core.verify.invariants import INVARIANTS, epoch_bounds
from odb_core.verify.model import GlobalModel, GlobalState, ModelConfig, round_robin_shards


def witness(mode: Mode = Mode.JOIN) -> ModelConfig:
    """Every sample fills the budget alone, K = 1: both bounds are reached (3, 4)."""
    protocol = ProtocolConfig(
        world_size=2,
        budget=Budget(4),
        buffer_size=1,
        mode=mode,
        max_steps_per_round=2,
        quota=5 if mode is Mode.QUOTA else None,
    )
    return ModelConfig(protocol, round_robin_shards([4] * 5, 2))


def reachable(cfg: ModelConfig) -> list[GlobalState]:
    model = GlobalModel(cfg)
    seen = {model.init()}
    queue = deque(seen)
    while queue:
        state = queue.popleft()
        for _, nxt in model.successors(state):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return list(seen)


STATES = {mode: reachable(witness(mode)) for mode in Mode}


def with_ranks(state: GlobalState, **changes: list[int]) -> GlobalState:
    ranks = tuple(
        rs._replace(**{k: v[r] for k, v in changes.items()}) for r, rs in enumerate(state.ranks)
    )
    return state._replace(ranks=ranks)


def steps(state: GlobalState) -> list[int]:
    return [rs.steps for rs in state.ranks]


def rounds(state: GlobalState) -> list[int]:
    return [rs.round for rs in state.ranks]


def failing(state: GlobalState, cfg: ModelConfig) -> dict[str, str]:
    reasons = {name: inv(state, cfg) for name, inv in INVARIANTS.items()}
    return {name: r for name, r in reasons.items() if r is not None}


@pytest.mark.parametrize("mode", list(Mode))
def test_the_witness_reaches_both_bounds_and_every_reachable_state_passes(mode: Mode) -> None:
    cfg = witness(mode)
    sb, rb = epoch_bounds(cfg)
    if mode is Mode.JOIN:
        assert (sb, rb) == (steps_bound(cfg.samples_per_rank), rounds_bound(cfg.samples_per_rank))
    assert max(max(steps(s)) for s in STATES[mode]) == sb
    assert max(max(rounds(s)) for s in STATES[mode]) == rb
    assert any(max(rounds(s)) - min(rounds(s)) == 1 for s in STATES[mode])
    for state in STATES[mode]:
        assert failing(state, cfg) == {}


@pytest.mark.parametrize("mode", list(Mode))
def test_one_step_over_the_steps_bound_is_caught(mode: Mode) -> None:
    cfg = witness(mode)
    sb, _ = epoch_bounds(cfg)
    at = [s for s in STATES[mode] if max(steps(s)) == sb]
    assert at
    for state in at:
        assert INVARIANTS["BoundedTermination"](state, cfg) is None
        over = with_ranks(state, steps=[n + 1 if n == sb else n for n in steps(state)])
        reason = INVARIANTS["BoundedTermination"](over, cfg)
        assert reason is not None and f"ran {sb + 1} steps > bound {sb}" in reason


@pytest.mark.parametrize("mode", list(Mode))
def test_one_round_over_the_rounds_bound_is_caught(mode: Mode) -> None:
    cfg = witness(mode)
    sb, rb = epoch_bounds(cfg)
    at = [s for s in STATES[mode] if max(rounds(s)) == rb]
    assert at
    for state in at:
        assert INVARIANTS["BoundedTermination"](state, cfg) is None
        over = with_ranks(state, round=[n + 1 if n == rb else n for n in rounds(state)])
        assert max(steps(over)) <= sb
        reason = INVARIANTS["BoundedTermination"](over, cfg)
        assert reason is not None and f"ran {rb + 1} rounds > bound {rb}" in reason


@pytest.mark.parametrize("mode", list(Mode))
def test_ranks_two_rounds_apart_are_caught(mode: Mode) -> None:
    cfg = witness(mode)
    skewed = [s for s in STATES[mode] if max(rounds(s)) - min(rounds(s)) == 1]
    assert skewed
    for state in skewed:
        assert INVARIANTS["CollectiveAlignment"](state, cfg) is None
        ahead = max(range(2), key=lambda r: state.ranks[r].round)
        bumped = [rs.round + (1 if r == ahead else 0) for r, rs in enumerate(state.ranks)]
        over = with_ranks(state, round=bumped)
        reason = INVARIANTS["CollectiveAlignment"](over, cfg)
        assert reason is not None and "more than one collective apart" in reason


def test_a_rank_snapshot_has_the_fields_these_states_change() -> None:
    assert {"steps", "pads", "round"} <= set(RankSnapshot._fields)
