"""How many aligned steps an epoch will take, before it runs.

The real count is decided online from the samples' costs, so a trainer that
sizes an LR schedule or a progress bar before the epoch needs an estimate. It
is made by the core itself: the rank machine (world size 1, the same budget,
cost model, former and window) forms batches from bootstrap draws of a small
sample of measured costs, for each rank's shard size; in join mode the epoch
runs as many steps as its busiest rank has batches, in quota mode until the
first rank runs dry or, step by step in each rank's simulated order, the ranks
together have emitted the quota. Every rank computes it from
the same inputs, so every rank gets the same figure.

After an epoch has run, its realised count is the better guide: `update`
folds it in. `upper` is what a trainer should size a schedule to; it is an
estimate with a margin, not a proof (the proven bound, `steps_bound`, is one
step per sample), so an adapter must never cut an epoch at it.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from odb_core.config import Mode, ProtocolConfig, Sharding
from odb_core.errors import ConfigError
from odb_core.protocol import RankMachine, oversize_refusal, steps_bound
from odb_core.sample import Sample

#: Samples per simulated shard; longer shards are scaled linearly from this many.
SIMULATED_SAMPLES = 4096
#: Ranks simulated one by one; the others reuse their counts.
MAX_SIMULATED_RANKS = 16
#: Relative margin of `upper` over the largest bootstrap replicate (or epoch seen).
MARGIN = 0.05


class StepsEstimate(NamedTuple):
    """`steps`: central estimate of an epoch's aligned steps; `upper`: what to size
    a schedule to; `basis`: where the figures come from, for logs and docs."""

    steps: int
    upper: int
    basis: str


class _RankProfile(NamedTuple):
    """One rank's simulated epoch alone: its batches, and the samples it has
    emitted after each of them, both scaled to the rank's shard size."""

    batches: float
    cumulative: tuple[int, ...]  # samples after batch 1, 2, ... of the simulation
    scale: float  # shard size over simulated samples

    def emitted_after(self, steps: float) -> float:
        if not self.cumulative:
            return 0.0
        k = min(len(self.cumulative), int(steps / self.scale))
        return self.scale * (self.cumulative[k - 1] if k > 0 else 0)


def _profile(
    config: ProtocolConfig, costs: Sequence[Sample], n: int, rng: random.Random
) -> _RankProfile:
    """Run one rank alone over `n` samples drawn from `costs` (scaled past
    SIMULATED_SAMPLES), emitting every sample."""
    if n == 0:
        return _RankProfile(0.0, (), 1.0)
    m = min(n, SIMULATED_SAMPLES)
    draws = [costs[rng.randrange(len(costs))] for _ in range(m)]
    # Optimizer windows and `deterministic` do not change what the former forms,
    # so they are kept; a pass's carried ids go with quota mode (a join config
    # refuses them). A rank alone reads its whole share: dynamic sharding's deals only
    # balance the ranks' shares, which `estimate_epoch_steps` takes as given.
    single = replace(
        config,
        world_size=1,
        mode=Mode.JOIN,
        quota=None,
        carried=frozenset(),
        sharding=Sharding.STATIC,
        plan=(),
    )
    machine = RankMachine(0, single)
    source = iter(draws[i]._replace(id=i) for i in range(m))
    cumulative: list[int] = []
    while machine.phase.value != "done":
        contribution = machine.fill(lambda: next(source, None))
        for step in machine.all_gather([contribution]).steps:
            cumulative.append((cumulative[-1] if cumulative else 0) + step.local_samples)
    return _RankProfile(machine.steps * n / m, tuple(cumulative), n / m)


def _quota_steps(profiles: Sequence[_RankProfile], quota: int) -> float:
    """The first step after which the ranks together have emitted `quota` samples:
    each step every rank emits its next batch, so the order the former emits in
    (long samples first from a sorted window) counts, not only the mean batch."""
    last = max(p.batches for p in profiles)

    def reached(step: float) -> bool:
        return sum(p.emitted_after(step) for p in profiles) >= quota

    if not reached(last):
        return last
    lo, hi = 0, math.ceil(last)  # not reached at lo, reached at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reached(mid) else (mid, hi)
    return float(hi)


def estimate_epoch_steps(
    config: ProtocolConfig,
    costs: Sequence[Sample],
    shard_sizes: Sequence[int],
    *,
    replicates: int = 5,
    seed: int = 0,
) -> StepsEstimate:
    """Estimate the aligned steps of an epoch whose ranks hold `shard_sizes`
    samples, from `costs`, a sample of measured costs of the dataset."""
    if len(shard_sizes) != config.world_size:
        raise ConfigError(f"{len(shard_sizes)} shard sizes for world_size={config.world_size}")
    if any(n < 0 for n in shard_sizes):
        raise ConfigError(f"shard sizes {list(shard_sizes)} must be >= 0")
    if replicates < 1:
        raise ConfigError(f"replicates={replicates!r} must be >= 1")
    for s in costs:  # by its own id: the draws below are numbered apart
        refusal = oversize_refusal(s, config, "the step estimate")
        if refusal is not None:
            raise refusal
    bound = steps_bound(shard_sizes)
    if not costs or bound == 0:
        return StepsEstimate(bound, bound, "the proven bound (no cost sample)")
    rng = random.Random(seed)
    totals = []
    # Each rank draws its own shard: the epoch ends with its busiest rank, and the
    # maximum of W noisy counts lies above their mean. Past MAX_SIMULATED_RANKS
    # ranks the extra ones repeat the simulated ones' counts (an underestimate
    # of that maximum, which `upper`'s margin covers).
    simulated = shard_sizes[:MAX_SIMULATED_RANKS]
    for _ in range(replicates):
        runs = [_profile(config, costs, n, rng) for n in simulated]
        profiles = [runs[r % len(runs)] for r in range(len(shard_sizes))]
        per_rank = [p.batches for p in profiles]
        if config.mode is Mode.JOIN:
            steps = max(per_rank)
        else:
            steps = min(per_rank)
            if config.quota is not None:
                steps = min(steps, _quota_steps(profiles, config.quota))
        totals.append(steps)
    central = min(bound, max(1, math.ceil(statistics.median(totals))))
    upper = min(bound, math.ceil(max(totals) * (1 + MARGIN)) + 1)
    return StepsEstimate(
        central,
        max(upper, central),
        f"{replicates} simulations of the former on bootstrap draws from {len(costs)} "
        "measured samples",
    )


def update(previous: StepsEstimate, realised: Sequence[int]) -> StepsEstimate:
    """Fold the realised step counts of finished epochs into an estimate."""
    if not realised:
        return previous
    central = math.ceil(statistics.median(realised))
    upper = max(previous.upper, math.ceil(max(realised) * (1 + MARGIN)) + 1)
    return StepsEstimate(
        central, upper, f"median of {len(realised)} finished epoch(s); upper with margin"
    )
