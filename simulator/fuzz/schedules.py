"""The schedules an adversary draws: the world size, each rank's samples and their
arrival order, a protocol config, and the timing knobs (per-rank speeds,
stragglers, how eagerly a waiting rank prefetches, when a dry rank notices it is
dry, and when each rank leaves the collective). `random_schedule(seed, ...)` is a
function of its seed alone, so `odb fuzz --replay SEED` rebuilds it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from odb_core.config import Mode, OversizePolicy, ProtocolConfig, Sharding
from odb_core.cost import (
    AttentionAware,
    BatchStats,
    Budget,
    CostModel,
    Multimodal,
    PackedTokens,
    PaddedTokens,
)
from odb_core.formers import FormerKind
from odb_core.sample import Sample

ORDERS = ("shuffled", "ascending", "descending", "alternating")


@dataclass
class Schedule:
    seed: int
    world: int
    shards: list[list[Sample]]
    config: ProtocolConfig
    speeds: list[float]
    prefetch_prob: float
    exhaust_delay: float
    receive_delay: float
    order: str
    origin: str = "random"

    @property
    def n(self) -> int:
        return sum(len(s) for s in self.shards)

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "seed": self.seed,
            "origin": self.origin,
            "world_size": self.world,
            "samples": self.n,
            "max_samples_per_rank": max((len(s) for s in self.shards), default=0),
            "empty_ranks": sum(1 for s in self.shards if not s),
            "budget": c.budget.tokens,
            "max_samples": c.budget.max_samples,
            "max_patches": c.budget.max_patches,
            "cost_model": c.cost_model.name,
            "buffer_size": c.buffer_size,
            "max_steps_per_round": c.max_steps_per_round,
            "mode": c.mode.value,
            "quota": c.quota,
            "former": c.former.value,
            "oversize": c.oversize.value,
            "grad_accum_steps": c.grad_accum_steps,
            "tokens_per_update": c.tokens_per_update,
            "arrival_order": self.order,
            "stragglers": sum(1 for s in self.speeds if s < 0.05),
            "sharding": c.sharding.value,
        }

    def dynamic(self) -> Schedule:
        """The same schedule with dynamic sharding: the shards only hold the samples,
        and the plan (their ids, interleaved as a round-robin split would deal
        them) is dealt by the core (`odb_core.assign`)."""
        longest = max((len(s) for s in self.shards), default=0)
        plan = tuple(s[j].id for j in range(longest) for s in self.shards if j < len(s))
        config = replace(
            self.config, sharding=Sharding.DYNAMIC, plan=plan, carried=frozenset(), early_form=None
        )
        return replace(self, config=config)


# ---- schedule generation ----------------------------------------------------


def _world(rng: random.Random, max_ranks: int) -> int:
    u = rng.random()
    if u < 0.12:
        return max_ranks
    if u < 0.25:
        return rng.randint(1, min(2, max_ranks))
    if u < 0.5:
        return rng.randint(1, min(4, max_ranks))
    hi = max(1, max_ranks)
    return max(1, min(hi, round(2 ** rng.uniform(0, _log2(hi)))))


def _log2(x: int) -> float:
    return float(x.bit_length() - 1) if x > 1 else 0.0


def _cost_model(rng: random.Random) -> CostModel:
    k = rng.random()
    if k < 0.45:
        return PackedTokens()
    if k < 0.65:
        return PaddedTokens()
    if k < 0.85:
        return AttentionAware(rng.choice([1 / 4096, 1 / 256, 1 / 16, 0.5]))
    return Multimodal(rng.choice([0.25, 0.5, 1.0, 2.0]))


def _length(rng: random.Random, budget: int, allow_over: bool) -> int:
    k = rng.random()
    if k < 0.35:
        return rng.randint(1, max(1, budget // 8))
    if k < 0.65:
        return rng.randint(1, max(1, budget // 2))
    if k < 0.85:
        return rng.randint(max(1, budget // 2), budget)
    if k < 0.93 or not allow_over:
        return budget
    return rng.randint(budget + 1, budget * 3)


def _fits_alone(s: Sample, budget: Budget, model: CostModel) -> bool:
    return budget.fits(BatchStats().add(s), model)


def random_schedule(seed: int, max_ranks: int, samples_hint: int = 24) -> Schedule:
    """A schedule drawn from `seed` alone: `odb fuzz --replay SEED` rebuilds it."""
    rng = random.Random(seed)
    world = _world(rng, max_ranks)
    budget_tokens = rng.choice([4, 8, 16, 64, 256, 1024, 4096])
    model = _cost_model(rng)
    max_samples = rng.choice([None, None, None, 1, 2, 3, 8])
    max_patches = rng.choice([None, None, None, 4, 16])
    budget = Budget(budget_tokens, max_samples, max_patches)
    oversize = rng.choice(list(OversizePolicy))
    allow_over = oversize is not OversizePolicy.ERROR
    # Per-rank sample counts: uneven on purpose (empty ranks, one heavy rank).
    cap = max(1, min(samples_hint * 2, 4000 // max(1, world)))
    shape = rng.random()
    counts = []
    for _ in range(world):
        if shape < 0.3:
            counts.append(rng.randint(0, cap))
        elif shape < 0.6:
            counts.append(rng.choice([0, rng.randint(0, max(1, cap // 4))]))
        else:
            counts.append(rng.randint(max(0, cap // 2), cap))
    if world > 1 and rng.random() < 0.4:
        counts[rng.randrange(world)] = cap  # one long rank: the longest tail
    order = rng.choice(ORDERS)
    next_id = 0
    shards: list[list[Sample]] = []
    for c in counts:
        shard = []
        for _ in range(c):
            length = _length(rng, budget_tokens, allow_over)
            visual = rng.randint(0, length) if isinstance(model, Multimodal) else 0
            patches = rng.randint(0, 6) if max_patches is not None else 0
            s = Sample(next_id, length - visual, visual, patches)
            if oversize is OversizePolicy.TRUNCATE and not _fits_alone(
                s._replace(tokens=0), budget, model
            ):
                s = Sample(next_id, length, 0, 0)  # keep truncation possible
                if not _fits_alone(s._replace(tokens=0), budget, model):
                    s = Sample(next_id, 1, 0, 0)
            if oversize is OversizePolicy.ERROR and not _fits_alone(s, budget, model):
                s = Sample(next_id, 1, 0, 0)
            shard.append(s)
            next_id += 1
        shards.append(_arrange(rng, shard, order))
    # Loss tokens and optimizer windows come from their own stream, so adding them
    # left every other knob of a seed as it was.
    lrng = random.Random(seed ^ 0x1055)
    if lrng.random() < 0.7:  # masked prompts: loss tokens apart from cost
        shards = [
            [s._replace(loss_tokens=lrng.randint(0, s.tokens)) for s in shard] for shard in shards
        ]
    window = lrng.choice(["none", "steps", "tokens"])
    mode = rng.choice([Mode.JOIN, Mode.JOIN, Mode.QUOTA])
    quota = None
    if mode is Mode.QUOTA and next_id > 0 and rng.random() < 0.6:
        quota = rng.randint(1, next_id)
    buffer_size = rng.choice([1, 1, 2, 3, 4, 8, 16, 64])
    # Early forms from their own stream too (join mode, a window above 1).
    erng = random.Random(seed ^ 0xEA21)
    early = erng.random() < 0.3 and mode is Mode.JOIN and buffer_size > 1
    config = ProtocolConfig(
        world_size=world,
        budget=budget,
        cost_model=model,
        buffer_size=buffer_size,
        mode=mode,
        former=rng.choice(list(FormerKind)),
        oversize=oversize,
        max_steps_per_round=rng.choice([1, 1, 2, 3, 8]),
        quota=quota,
        deterministic=rng.random() < 0.2,
        grad_accum_steps=lrng.randint(1, 6) if window == "steps" else None,
        tokens_per_update=lrng.randint(1, 4 * budget_tokens) if window == "tokens" else None,
        early_form=erng.randint(1, buffer_size - 1) if early else None,
    )
    speeds = [rng.uniform(0.05, 1.0) for _ in range(world)]
    for _ in range(rng.choice([0, 0, 1, 2])):
        speeds[rng.randrange(world)] = 0.01  # straggler
    return Schedule(
        seed=seed,
        world=world,
        shards=shards,
        config=config,
        speeds=speeds,
        prefetch_prob=rng.choice([0.0, 0.3, 0.7, 1.0]),
        exhaust_delay=rng.choice([0.0, 0.5, 0.95]),
        receive_delay=rng.choice([0.0, 0.5, 0.9]),
        order=order,
    )


def _arrange(rng: random.Random, shard: list[Sample], order: str) -> list[Sample]:
    if order == "ascending":
        return sorted(shard, key=lambda s: (s.length, s.id))
    if order == "descending":
        return sorted(shard, key=lambda s: (-s.length, s.id))
    if order == "alternating":
        srt = sorted(shard, key=lambda s: (s.length, s.id))
        out: list[Sample] = []
        while srt:
            out.append(srt.pop())
            if srt:
                out.append(srt.pop(0))
        return out
    shard = list(shard)
    rng.shuffle(shard)
    return shard
