"""The bounds, the determinism argument and how an epoch's optimizer windows end
(proofs/), checked exhaustively with the Python model (the TLC side is in
tests/test_tlc.py: BoundedTermination, the bound witnesses, the inductive-invariant
models, WindowAlignment)."""

from __future__ import annotations

from functools import cache

import pytest

from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import Budget
from odb_core.protocol import rounds_bound, steps_bound
from odb_core.verify.checker import check
from odb_core.verify.model import GlobalModel, GlobalState, ModelConfig, round_robin_shards

Emission = tuple[tuple[tuple[int, ...] | None, ...], ...]


def model(world: int, costs: list[int], k: int, mode: Mode, **kw: object) -> ModelConfig:
    protocol = ProtocolConfig(
        world_size=world,
        budget=Budget(4),
        buffer_size=k,
        mode=mode,
        max_steps_per_round=2,
        **kw,  # type: ignore[arg-type]
    )
    return ModelConfig(protocol, round_robin_shards(costs, world))


def schedule_bound(cfg: ModelConfig) -> int:
    """proofs/bounded_termination.md: actions in one epoch <= 2N + W + (2W + 1)(S + 1)."""
    n, w = cfg.n_samples, cfg.protocol.world_size
    return 2 * n + w + (2 * w + 1) * (steps_bound(cfg.samples_per_rank) + 1)


GRID = [(2, 4, 1), (2, 5, 1), (3, 6, 1), (2, 6, 2), (3, 7, 2), (2, 8, 3), (3, 8, 1)]
COSTS = {"mixed": lambda n: [(i % 3) + 1 for i in range(n)], "full": lambda n: [4] * n}


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize(("world", "n", "k"), GRID)
@pytest.mark.parametrize("costs", list(COSTS))
def test_no_schedule_exceeds_the_bounds(mode: Mode, world: int, n: int, k: int, costs: str) -> None:
    cfg = model(world, COSTS[costs](n), k, mode)
    r = check(cfg)
    assert r.ok
    assert r.max_steps_seen <= steps_bound(cfg.samples_per_rank)
    assert r.max_rounds_seen <= rounds_bound(cfg.samples_per_rank)
    assert r.longest_schedule <= schedule_bound(cfg)
    if k == 1 and mode is Mode.JOIN:
        # With a window of one, some schedule takes every action the bound counts.
        assert r.longest_schedule == schedule_bound(cfg)


WINDOWED = [
    # (world, costs, loss, K, mode, quota, window option)
    (2, [1, 2, 3, 1, 2], [0, 2, 1, 1, 0], 1, Mode.JOIN, None, {"grad_accum_steps": 2}),
    (2, [1, 2, 3, 1, 2, 3], [1, 0, 1, 1, 0, 1], 2, Mode.JOIN, None, {"tokens_per_update": 3}),
    (3, [1, 2, 3, 1, 2, 3], [0, 1, 2, 1, 1, 0], 1, Mode.JOIN, None, {"tokens_per_update": 3}),
    (
        2,
        [1, 2, 3, 1, 2, 3, 1, 2],
        [0, 1, 2, 1, 1, 0, 1, 1],
        2,
        Mode.QUOTA,
        3,
        {"grad_accum_steps": 2},
    ),
    (2, [1, 2, 3, 1, 2, 3], [0, 1, 2, 1, 1, 0], 1, Mode.QUOTA, None, {"grad_accum_steps": 2}),
    (3, [4, 4, 4, 4, 4], [0, 0, 1, 0, 0], 1, Mode.JOIN, None, {"grad_accum_steps": 3}),
]


@pytest.mark.parametrize(("world", "costs", "loss", "k", "mode", "quota", "window"), WINDOWED)
def test_every_epoch_ends_with_its_last_window_closed_and_exact(
    world: int,
    costs: list[int],
    loss: list[int],
    k: int,
    mode: Mode,
    quota: int | None,
    window: dict[str, int],
) -> None:
    """proofs/window_alignment.md, on every terminal state: the last window closes
    with the epoch on every rank, the windows partition the steps, every rank
    has the same windows, and the windows' loss tokens are exactly those of the
    samples emitted (each window's the sum of the ranks' own)."""
    protocol = ProtocolConfig(
        world_size=world,
        budget=Budget(4),
        buffer_size=k,
        mode=mode,
        quota=quota,
        max_steps_per_round=2,
        **window,  # type: ignore[arg-type]
    )
    cfg = ModelConfig(protocol, round_robin_shards(costs, world, loss))
    r = check(cfg, keep_graph=True)
    assert r.ok and r.graph is not None
    terminal = [d["state"] for n, d in r.graph.nodes(data=True) if r.graph.out_degree(n) == 0]
    assert terminal and len(terminal) == r.terminal_states
    g, t = protocol.accum_steps, protocol.tokens_per_update
    for state in terminal:
        ranks = state.ranks
        assert len({tuple((w.end, w.loss) for w in rs.windows) for rs in ranks}) == 1
        emitted = sum(loss[i] for i, d in enumerate(state.delivered) if d)
        for rs in ranks:
            assert rs.window_loss == rs.window_local == 0
            assert (rs.windows[-1].end if rs.windows else 0) == rs.steps
            assert sum(w.loss for w in rs.windows) == emitted
            if t is None:
                assert len(rs.windows) == -(-rs.steps // g)
            else:
                assert all(w.loss >= t for w in rs.windows[:-1])
        for i, w in enumerate(ranks[0].windows):
            assert sum(rs.windows[i].local for rs in ranks) == w.loss


def emissions(cfg: ModelConfig) -> set[Emission]:
    """Every per-rank step sequence (ids of each step, None for a pad) that some
    schedule of `cfg` produces, by dynamic programming over the state graph."""
    m = GlobalModel(cfg)

    @cache
    def suffixes(state: GlobalState) -> frozenset[Emission]:
        out: set[Emission] = set()
        for action in m.enabled(state):
            nxt, result = m.step_with_output(state, action)
            emitted: list[tuple[tuple[int, ...] | None, ...]] = [() for _ in range(m.world)]
            if result is not None and action.rank is not None:
                steps = tuple(None if s.is_pad else s.sample_ids for s in result.steps)
                emitted[action.rank] = steps
            for rest in suffixes(nxt):
                out.add(tuple(e + r for e, r in zip(emitted, rest, strict=True)))
        if not out:
            out.add(tuple(() for _ in range(m.world)))
        return frozenset(out)

    return set(suffixes(m.init()))


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize(("world", "n", "k"), [(2, 6, 2), (3, 6, 1), (2, 7, 3), (3, 8, 2)])
def test_deterministic_mode_emits_the_same_steps_on_every_schedule(
    mode: Mode, world: int, n: int, k: int
) -> None:
    costs = [(i * 5) % 4 + 1 for i in range(n)]
    assert len(emissions(model(world, costs, k, mode, deterministic=True))) == 1
    assert len(emissions(model(world, costs, k, mode))) > 1  # arrival order matters
