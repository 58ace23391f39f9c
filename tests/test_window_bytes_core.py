"""The window's byte bound in the core (`ProtocolConfig.window_bytes`): a window whose
bytes reach the bound forms early (the spec's FormEarly, taken by the core), a
waiting rank prefetches only below it, and a byte-bounded run is a behaviour of the
model with EarlyForm = 1 (its trace validates), with every sample emitted once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core.collective import Contribution
from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import Budget, PaddedTokens
from odb_core.errors import ConfigError
from odb_core.protocol import RankAction, RankMachine, RankPhase
from odb_core.sample import Sample
from odb_core.trace import ProtocolTrace, TracingRankMachine
from odb_core.verify.checker import check
from odb_core.verify.model import ModelConfig, round_robin_shards
from odb_core.verify.trace_validation import validate_trace


class IgnoresTheBound(TracingRankMachine):
    """Broken: the window never counts as byte-full."""

    @property
    def byte_full(self) -> bool:
        return False


def _run(
    config: ProtocolConfig,
    shards: list[list[tuple[Sample, int]]],
    machine: type[TracingRankMachine] = TracingRankMachine,
) -> tuple[list[TracingRankMachine], list[list[list[int]]], int]:
    """Every rank in one process, round by round. Returns the machines, each rank's
    emitted steps (ids, [] for a pad) and the most bytes a window held after an
    observation that the core allowed while the window was below its bound."""
    ms = [machine(r, config) for r in range(config.world_size)]
    sources = [list(s) for s in shards]
    steps: list[list[list[int]]] = [[] for _ in ms]
    peak = 0

    def puller(r: int) -> Callable[[], Sample | None]:
        def pull() -> Sample | None:
            nonlocal peak
            if not sources[r]:
                return None
            s, n = sources[r].pop(0)
            # fill() observes what pull returns; count the window it will hold.
            if not ms[r].formed:
                peak = max(peak, ms[r].window_bytes + n)
            ms[r].observe(s, n)
            return _OBSERVED

        return pull

    while ms[0].phase is not RankPhase.DONE:
        for r, m in enumerate(ms):
            _fill(m, puller(r))
        cs: list[Contribution] = [m.contribution for m in ms]  # type: ignore[misc]
        for r, m in enumerate(ms):
            for info in m.all_gather(cs).steps:
                steps[r].append([] if info.batch is None else [s.id for s in info.batch.samples])
    return ms, steps, peak


_OBSERVED = Sample(-1, 0)


def _fill(m: RankMachine, pull: Callable[[], Sample | None]) -> None:
    """`RankMachine.fill`, with the observation done by `pull` (it needs the size)."""
    while True:
        enabled = m.enabled()
        if RankAction.CONTRIBUTE in enabled:
            m.contribute()
            return
        if RankAction.FORM in enabled:
            m.form()
        elif RankAction.FORM_EARLY in enabled and RankAction.OBSERVE not in enabled:
            m.form_early()
        elif pull() is None:
            m.exhaust()


def _config(world: int, k: int, bound: int | None, budget: int = 8) -> ProtocolConfig:
    return ProtocolConfig(
        world_size=world,
        budget=Budget(budget),
        cost_model=PaddedTokens(),
        buffer_size=k,
        max_steps_per_round=2,
        window_bytes=bound,
    )


samples = st.lists(st.tuples(st.integers(1, 8), st.integers(1, 50)), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 3),
    k=st.integers(2, 10),
    bound=st.integers(1, 200),
    xs=samples,
)
def test_a_byte_bounded_run_keeps_every_guarantee_and_is_a_spec_behaviour(
    world: int, k: int, bound: int, xs: list[tuple[int, int]]
) -> None:
    cfg = _config(world, k, bound)
    shards: list[list[tuple[Sample, int]]] = [[] for _ in range(world)]
    for i, (tokens, size) in enumerate(xs):
        shards[i % world].append((Sample(i, tokens), size))
    ms, steps, peak = _run(cfg, shards)
    assert len({len(s) for s in steps}) == 1  # equal steps
    emitted = Counter(i for rank in steps for step in rank for i in step)
    assert emitted == Counter(range(len(xs)))  # exactly once
    # An observation below the bound: at most the bound less one byte, plus that sample.
    assert peak <= bound - 1 + max(n for _, n in xs)
    report = validate_trace(ProtocolTrace.from_machines(ms))
    assert report.ok, report.reason


def test_the_bound_narrows_the_window_and_a_broken_machine_that_ignores_it_is_caught() -> None:
    xs = [(Sample(i, 2), 10) for i in range(12)]  # 4 per batch, 10 bytes each
    cfg = _config(1, 12, 25)
    _, steps, peak = _run(cfg, [xs])
    assert peak <= 25 - 1 + 10
    assert sorted(i for s in steps[0] for i in s) == list(range(12))
    _, _, broken = _run(cfg, [xs], IgnoresTheBound)
    assert broken > 25 - 1 + 10  # the whole window of 12 (120 bytes)


def test_a_byte_full_window_forms_early_and_counts_its_batches_until_emitted() -> None:
    m = RankMachine(0, _config(1, 8, 30))
    for i in range(3):  # one sample per batch (8 tokens of a budget of 8), 10 bytes each
        assert RankAction.FORM_EARLY not in m.enabled()
        m.observe(Sample(i, 8), 10)
    assert m.enabled() == {RankAction.FORM_EARLY}  # byte-full: the core forms
    assert [s.id for b in m.form_early() for s in b.samples] == [0]
    assert m.window_bytes == 30  # the formed batch is held until its step
    c = m.contribute()
    assert not m.needs_sample  # no prefetch at the bound
    m.all_gather([c])
    assert m.window_bytes == 20 and m.needs_sample  # formed once: the next sample


def test_a_waiting_rank_prefetches_only_below_the_bound() -> None:
    m = RankMachine(0, _config(1, 2, 25))
    m.observe(Sample(0, 8), 10)
    m.observe(Sample(1, 8), 10)
    m.form()  # a full window of 2: one batch ready, the open one kept
    m.contribute()
    assert m.needs_sample  # 20 < 25: prefetch while the collective is in flight
    m.observe(Sample(2, 8), 10)
    assert not m.needs_sample  # 30: it waits for the round


def test_no_bound_keeps_the_machine_as_it_was() -> None:
    m = RankMachine(0, _config(1, 4, None))
    for i in range(3):
        m.observe(Sample(i, 8), 10**9)
    assert m.enabled() == {RankAction.OBSERVE, RankAction.EXHAUST}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"window_bytes": 0}, "window_bytes=0"),
        ({"window_bytes": 10, "mode": Mode.QUOTA}, "needs mode='join'"),
    ],
)
def test_window_bytes_config_is_validated(change: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "world_size": 1,
        "budget": Budget(4),
        "cost_model": PaddedTokens(),
        "buffer_size": 8,
    }
    with pytest.raises(ConfigError, match=message):
        ProtocolConfig(**{**base, **change})  # type: ignore[arg-type]


def test_a_negative_size_is_refused() -> None:
    m = RankMachine(0, _config(1, 4, 10))
    with pytest.raises(Exception, match="nbytes=-1"):
        m.observe(Sample(0, 1), -1)


def test_every_interleaving_of_the_spec_with_early_form_one_keeps_every_guarantee() -> None:
    """What the byte bound's forms are checked against: a byte-full form is a
    FormEarly at any window of at least one sample (EarlyForm = 1), at two ranks."""
    protocol = ProtocolConfig(
        world_size=2,
        budget=Budget(4),
        cost_model=PaddedTokens(),
        buffer_size=3,
        max_steps_per_round=2,
        early_form=1,
    )
    r = check(ModelConfig(protocol, round_robin_shards([1, 3, 2, 2, 3, 1], 2)))
    assert r.complete and r.ok, [v.to_json() for v in r.violations]
    assert r.deadlocks == 0 and r.acyclic and r.max_steps_seen <= r.steps_bound
