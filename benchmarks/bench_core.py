"""Core benchmarks (issue 2): former throughput, batch quality, checker speed.

Run with `make bench`. Targets: greedy former >= 300k samples/s with a 4,096
window; padded budget use >= 0.90 with a 128 window on the lognormal stream;
checker >= 20k states/s.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from odb_core.config import ProtocolConfig
from odb_core.cost import BatchStats, Budget, PackedTokens, PaddedTokens
from odb_core.formers import FORMERS, FormerKind
from odb_core.protocol import RankMachine
from odb_core.sample import Sample
from odb_core.verify.checker import check
from odb_core.verify.model import ModelConfig, round_robin_shards


def lognormal_stream(n: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(300), 1.0, size=n), 16, 8192).astype(int)
    return [Sample(i, int(x)) for i, x in enumerate(lengths)]


def stream_through_former(samples: list[Sample], kind: FormerKind, window: int) -> int:
    former = FORMERS[kind]
    budget, model = Budget(8192), PaddedTokens()
    buf: list[Sample] = []
    it = iter(samples)
    batches = 0
    while True:
        for s in it:
            buf.append(s)
            if len(buf) == window:
                break
        if not buf:
            return batches
        result = former(buf, budget, model, len(buf) < window)
        batches += len(result.batches)
        buf = result.leftovers


@pytest.mark.parametrize("kind", list(FormerKind), ids=lambda k: k.value)
def test_former_throughput(benchmark: BenchmarkFixture, kind: FormerKind) -> None:
    samples = lognormal_stream(40_000)
    window = 4096 if kind is FormerKind.SORT_WINDOW_GREEDY else 256
    benchmark.pedantic(stream_through_former, args=(samples, kind, window), rounds=5)
    assert benchmark.stats is not None
    per_s = len(samples) / benchmark.stats.stats.median
    benchmark.extra_info["samples_per_s"] = round(per_s)
    benchmark.extra_info["window"] = window


def batch_quality(window: int, kind: FormerKind) -> dict[str, float]:
    samples = lognormal_stream(5000)
    cfg = ProtocolConfig(
        world_size=1,
        budget=Budget(8192),
        cost_model=PaddedTokens(),
        buffer_size=window,
        former=kind,
    )
    m = RankMachine(0, cfg)
    it = iter(samples)
    batches = []
    done = False
    while not done:
        c = m.fill(lambda: next(it, None))
        result = m.all_gather([c])
        done = result.done
        batches += [s.batch for s in result.steps if s.batch is not None]
    padded = sum(PaddedTokens().cost(BatchStats.of(b.samples)) for b in batches)
    lower = math.ceil(sum(s.length for s in samples) / 8192)
    return {
        "budget_use": padded / (len(batches) * 8192),
        "batches": len(batches),
        "batches_over_lower_bound": len(batches) / lower,
    }


@pytest.mark.parametrize("window", [4, 128, 1024])
@pytest.mark.parametrize("kind", list(FormerKind), ids=lambda k: k.value)
def test_batch_quality(benchmark: BenchmarkFixture, window: int, kind: FormerKind) -> None:
    quality = benchmark.pedantic(batch_quality, args=(window, kind), rounds=1)
    benchmark.extra_info.update({k: round(v, 3) for k, v in quality.items()})


def padded_fraction(window: int | None) -> dict[str, float]:
    """Padding of the greedy former streamed at `window` (None: one offline sort and cut
    of the whole stream, what gmt does) on the lognormal stream, padded cost."""
    samples = lognormal_stream(5000)
    budget, model = Budget(8192), PaddedTokens()
    if window is None:
        batches = FORMERS[FormerKind.SORT_WINDOW_GREEDY](samples, budget, model, True).batches
    else:
        cfg = ProtocolConfig(world_size=1, budget=budget, cost_model=model, buffer_size=window)
        m = RankMachine(0, cfg)
        it = iter(samples)
        batches, done = [], False
        while not done:
            result = m.all_gather([m.fill(lambda: next(it, None))])
            done = result.done
            batches += [s.batch for s in result.steps if s.batch is not None]
    padded = sum(model.cost(BatchStats.of(b.samples)) for b in batches)
    return {"padding": 1 - sum(s.length for s in samples) / padded, "batches": len(batches)}


@pytest.mark.parametrize("window", [256, 1024, None], ids=["256", "1024", "offline"])
def test_padding_vs_offline_sort(benchmark: BenchmarkFixture, window: int | None) -> None:
    out = benchmark.pedantic(padded_fraction, args=(window,), rounds=1)
    benchmark.extra_info.update({k: round(v, 4) for k, v in out.items()})


def test_checker_states_per_second(benchmark: BenchmarkFixture) -> None:
    protocol = ProtocolConfig(world_size=2, budget=Budget(4), buffer_size=1, max_steps_per_round=2)
    cfg = ModelConfig(protocol, round_robin_shards([(i % 3) + 1 for i in range(8)], 2))
    report = benchmark.pedantic(check, args=(cfg,), rounds=3)
    benchmark.extra_info["states"] = report.states
    assert benchmark.stats is not None
    benchmark.extra_info["states_per_wall_s"] = round(report.states / benchmark.stats.stats.median)
    benchmark.extra_info["states_per_cpu_s"] = round(report.states_per_s)


def test_packed_budget_fill(benchmark: BenchmarkFixture) -> None:
    samples = lognormal_stream(20_000)

    def fill() -> float:
        r = FORMERS[FormerKind.SORT_WINDOW_GREEDY](samples, Budget(8192), PackedTokens(), True)
        return sum(s.length for s in samples) / (len(r.batches) * 8192)

    benchmark.extra_info["budget_fill"] = round(benchmark.pedantic(fill, rounds=1), 4)
