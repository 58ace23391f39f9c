"""Fuzz campaigns: many random schedules (`fuzz`) and hypothesis searches that
steer schedules towards the proven bounds (`hypothesis_search`); `replay` reruns
one random schedule from its seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from odb_core.config import Mode, ProtocolConfig, Sharding
from odb_core.cost import Budget, CostModel, PackedTokens, PaddedTokens
from odb_core.formers import FormerKind
from odb_core.protocol import RankMachine
from odb_core.sample import Sample
from simulator.fuzz.driver import Outcome, run_schedule
from simulator.fuzz.findings import FuzzReport, bound_ratio
from simulator.fuzz.schedules import Schedule, random_schedule

_SEARCH_COSTS: list[CostModel] = [PackedTokens(), PaddedTokens()]


def fuzz(
    max_ranks: int,
    schedules: int,
    seed: int = 0,
    *,
    machine: type[RankMachine] = RankMachine,
    search_examples: int | None = None,
    progress: Callable[[int], None] | None = None,
    sharding: Sharding = Sharding.STATIC,
) -> FuzzReport:
    """`schedules` random schedules (seeds seed..seed+schedules-1) plus hypothesis-driven
    searches for long tails and many steps (`search_examples` each; default
    schedules // 5)."""
    report = FuzzReport()
    start = time.perf_counter()
    for i in range(schedules):
        sched = random_schedule(seed + i, max_ranks)
        if sharding is Sharding.DYNAMIC:
            sched = sched.dynamic()
        report.add(run_schedule(sched, machine))
        if progress is not None:
            progress(1)
    examples = schedules // 5 if search_examples is None else search_examples
    if examples > 0:
        for objective in ("steps", "tail"):
            for o in hypothesis_search(max_ranks, examples, objective, seed, machine):
                report.add(o)
                if progress is not None:
                    progress(0)
    report.elapsed_s = time.perf_counter() - start
    return report


def hypothesis_search(
    max_ranks: int,
    examples: int,
    objective: str,
    seed: int = 0,
    machine: type[RankMachine] = RankMachine,
) -> list[Outcome]:
    """Let hypothesis steer schedules towards many steps (relative to the bound) or
    long pad tails, via `hypothesis.target`. Returns every outcome it ran."""
    from hypothesis import HealthCheck, Phase, given, settings, target
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    outcomes: list[Outcome] = []
    world_cap = max(1, min(max_ranks, 16))

    @st.composite
    def schedules(draw: st.DrawFn) -> Schedule:
        world = draw(st.integers(1, world_cap))
        budget = draw(st.sampled_from([1, 2, 4, 8, 16]))
        lengths = st.integers(1, budget)
        shards_len = draw(st.lists(st.lists(lengths, max_size=24), min_size=world, max_size=world))
        ids = 0
        shards: list[list[Sample]] = []
        for lens in shards_len:
            shard = []
            for ln in lens:
                shard.append(Sample(ids, ln))
                ids += 1
            shards.append(shard)
        mode = draw(st.sampled_from([Mode.JOIN, Mode.QUOTA]))
        config = ProtocolConfig(
            world_size=world,
            budget=Budget(budget, draw(st.sampled_from([None, 1, 2]))),
            cost_model=draw(st.sampled_from(_SEARCH_COSTS)),
            buffer_size=draw(st.integers(1, 8)),
            mode=mode,
            former=draw(st.sampled_from(list(FormerKind))),
            max_steps_per_round=draw(st.integers(1, 4)),
        )
        speeds = draw(st.lists(st.sampled_from([0.01, 0.2, 1.0]), min_size=world, max_size=world))
        return Schedule(
            seed=draw(st.integers(0, 2**31)),
            world=world,
            shards=shards,
            config=config,
            speeds=speeds,
            prefetch_prob=draw(st.sampled_from([0.0, 0.5, 1.0])),
            exhaust_delay=draw(st.sampled_from([0.0, 0.9])),
            receive_delay=draw(st.sampled_from([0.0, 0.9])),
            order="hypothesis",
            origin=f"hypothesis:{objective}",
        )

    @hseed(seed)
    @settings(
        max_examples=examples,
        phases=(Phase.generate, Phase.target),
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(schedules())
    def search(sched: Schedule) -> None:
        o = run_schedule(sched, machine)
        outcomes.append(o)
        if o.ok:
            if objective == "steps":
                target(bound_ratio(o.steps, o.steps_bound), label="steps / steps_bound")
                target(float(o.steps), label="steps")
            else:
                target(float(o.tail), label="tail steps")
                target(bound_ratio(o.rounds, o.rounds_bound), label="rounds / rounds_bound")

    search()
    return outcomes


def replay(seed: int, max_ranks: int, machine: type[RankMachine] = RankMachine) -> Outcome:
    return run_schedule(random_schedule(seed, max_ranks), machine)
