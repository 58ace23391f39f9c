"""Adversarial schedules over W RankMachines, with every guarantee asserted.

A schedule fixes the world size, each rank's samples and their arrival order, a
protocol config, and the timing knobs an adversary controls: per-rank speeds,
stragglers, how eagerly a waiting rank prefetches, when a dry rank notices it is
dry, and when each rank leaves the collective. The driver interleaves the ranks'
local actions at random under those knobs (one action of one rank at a time, as
in the global model), fires the all-gather when every rank has contributed, and
lets each rank consume the gathered round at its own time. It decides nothing:
all protocol decisions are the machines'.

Checked on what the machines emit: step alignment (every rank emits the same
number of steps in every round and in the epoch), termination agreement, exact
loss normalisation (global counts equal the sum of local ones), window
alignment (every rank releases the same optimizer windows, each exact), exactly-once
coverage (join), quota closure and the ledger (quota), budget safety, pad
accounting, the proven bounds `steps_bound` / `rounds_bound`, deadlock freedom
and termination (no state without an enabled action, bounded number of actions).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from odb_core.assign import dynamic_bounds
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
from odb_core.errors import ODBError
from odb_core.formers import FormerKind
from odb_core.protocol import (
    Contribution,
    RankAction,
    RankMachine,
    RankPhase,
    RoundResult,
    StepInfo,
    rounds_bound,
    steps_bound,
)
from odb_core.sample import Sample
from odb_core.window import WindowBuffer

_SEARCH_COSTS: list[CostModel] = [PackedTokens(), PaddedTokens()]
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


@dataclass
class Outcome:
    schedule: Schedule
    violations: list[str] = field(default_factory=list)
    steps: int = 0
    rounds: int = 0
    pads: int = 0
    tail: int = 0
    actions: int = 0
    carried: int = 0
    steps_bound: int = 0
    rounds_bound: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> dict[str, Any]:
        return {
            **self.schedule.describe(),
            "steps": self.steps,
            "steps_bound": self.steps_bound,
            "rounds": self.rounds,
            "rounds_bound": self.rounds_bound,
            "pad_steps": self.pads,
            "tail_steps": self.tail,
            "tail_steps_bound": self.steps_bound,
            "carried": self.carried,
            "actions": self.actions,
            "violations": self.violations[:5],
        }


def _check_windows(
    cfg: ProtocolConfig, buffers: Sequence[WindowBuffer], released: Sequence[list[StepInfo]]
) -> None:
    """WindowAlignment on what each rank's training loop got: the same windows and
    boundaries everywhere, every step released final, each window's local loss
    tokens (samples) adding up to its global count, each window closed by its
    rule but the epoch's last."""
    if any(b.held for b in buffers):
        raise _Violation("WindowAlignment: a window was still open after the epoch ended")
    views = [
        [(s.step, s.window, s.sync_gradients, s.window_samples, s.window_loss_tokens) for s in r]
        for r in released
    ]
    if any(v != views[0] for v in views):
        raise _Violation("WindowAlignment: ranks released different windows or boundaries")
    totals: dict[int, list[int]] = {}
    for r in released:
        for s in r:
            if not s.final:
                raise _Violation(f"WindowAlignment: step {s.step} released without its scale")
            t = totals.setdefault(s.window, [0, 0, s.window_samples, s.window_loss_tokens, 0])
            t[0] += s.local_samples
            t[1] += s.local_loss_tokens
            t[4] += 1
    last = max(totals, default=-1)
    for w, (ls, ll, gs, gl, n) in totals.items():
        if (ls, ll) != (gs, gl):
            raise _Violation(
                f"WindowAlignment: window {w}: local sums ({ls}, {ll}) != window ({gs}, {gl})"
            )
        if w == last:
            continue
        steps = n // max(1, len(released))
        if cfg.tokens_per_update is not None and gl < cfg.tokens_per_update:
            raise _Violation(f"WindowAlignment: window {w} closed at {gl} loss tokens")
        if cfg.tokens_per_update is None and steps != cfg.accum_steps:
            raise _Violation(f"WindowAlignment: window {w} ran {steps} steps")


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


# ---- the driver -----------------------------------------------------------------


class _Runnable:
    """A set of ranks with O(1) add, remove and uniform choice."""

    def __init__(self) -> None:
        self.items: list[int] = []
        self.pos: dict[int, int] = {}

    def add(self, r: int) -> None:
        if r not in self.pos:
            self.pos[r] = len(self.items)
            self.items.append(r)

    def discard(self, r: int) -> None:
        i = self.pos.pop(r, None)
        if i is None:
            return
        last = self.items.pop()
        if i < len(self.items):
            self.items[i] = last
            self.pos[last] = i

    def __len__(self) -> int:
        return len(self.items)


class _Violation(Exception):
    pass


def run_schedule(
    sched: Schedule, machine: type[RankMachine] = RankMachine, max_actions: int | None = None
) -> Outcome:
    """Drive W machines through one schedule and check every guarantee."""
    out = Outcome(sched)
    try:
        _drive(sched, machine, out, max_actions)
    except _Violation as exc:
        out.violations.append(str(exc))
    except ODBError as exc:
        out.violations.append(f"{type(exc).__name__}: {exc}")
    return out


def _drive(
    sched: Schedule, machine_cls: type[RankMachine], out: Outcome, max_actions: int | None
) -> None:
    cfg, world = sched.config, sched.world
    rng = random.Random(sched.seed ^ 0x5EED)
    machines = [machine_cls(r, cfg) for r in range(world)]
    buffers = [WindowBuffer(cfg) for _ in range(world)]
    released: list[list[StepInfo]] = [[] for _ in range(world)]
    pending = [list(reversed(s)) for s in sched.shards]  # pop() = next arrival
    per_rank = [len(s) for s in sched.shards]
    out.steps_bound, out.rounds_bound = steps_bound(per_rank), rounds_bound(per_rank)
    by_id = {s.id: s for shard in sched.shards for s in shard}
    if cfg.dynamic:
        # A rank's source is what the core deals it, in order.
        pending = [[by_id[i] for i in reversed(m.queue)] for m in machines]
        out.steps_bound, out.rounds_bound = dynamic_bounds(len(cfg.plan), world, cfg.target)
    n = sched.n
    delivered = [0] * n
    carried: set[int] = set()
    inbox: list[tuple[Contribution, ...] | None] = [None] * world
    contributed = 0
    received: dict[int, int] = {}  # round -> ranks that consumed it
    round_info: dict[int, tuple[int, bool, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
    local_sums: dict[int, list[list[int]]] = {}
    first_pad_step: int | None = None
    budget, model = cfg.budget, cfg.cost_model
    limit = (
        max_actions or 50 * (n + world * (out.rounds_bound + 2) * (cfg.buffer_size + 4)) + 10_000
    )
    runnable = _Runnable()
    for r in range(world):
        runnable.add(r)
    actions = 0
    iterations = 0

    def refresh(r: int) -> None:
        m = machines[r]
        if (
            inbox[r] is not None
            or m.phase is RankPhase.FILLING
            or (m.phase is RankPhase.WAITING and RankAction.OBSERVE in m.enabled())
        ):
            runnable.add(r)
        else:
            runnable.discard(r)

    def receive(r: int) -> None:
        nonlocal first_pad_step
        m = machines[r]
        gathered = inbox[r]
        assert gathered is not None
        rnd = m.round
        if rnd + 1 > out.rounds_bound:
            raise _Violation(
                f"BoundedTermination: rank {r} enters round {rnd + 1} > bound {out.rounds_bound}"
            )
        queued = len(m.queue)
        res: RoundResult = m.all_gather(gathered)
        if cfg.dynamic:
            pending[r][:0] = [by_id[i] for i in reversed(list(m.queue)[queued:])]
        if m.steps > out.steps_bound:
            raise _Violation(
                f"BoundedTermination: rank {r} ran {m.steps} steps > bound {out.steps_bound}"
            )
        inbox[r] = None
        k = len(res.steps)
        gs = tuple(s.global_samples for s in res.steps)
        gt = tuple(s.global_tokens for s in res.steps)
        gl = tuple(s.global_loss_tokens for s in res.steps)
        released[r].extend(buffers[r].push(res))
        info = (k, res.done, gs, gt, gl)
        seen = round_info.setdefault(rnd, info)
        if seen != info:
            raise _Violation(
                f"StepAlignment: round {rnd}: rank {r} got (steps={k}, done={res.done}) but "
                f"another rank got (steps={seen[0]}, done={seen[1]})"
            )
        sums = local_sums.setdefault(rnd, [[0, 0, 0] for _ in range(k)])
        for t, s in enumerate(res.steps):
            if s.is_pad != (s.batch is None):
                raise _Violation(f"PadAccounting: rank {r} step {s.step}: is_pad={s.is_pad}")
            if s.is_pad:
                if first_pad_step is None or s.step < first_pad_step:
                    first_pad_step = s.step
                continue
            assert s.batch is not None
            if not s.batch.samples:
                raise _Violation(f"TypeOK: rank {r} step {s.step}: empty real batch")
            stats = BatchStats.of(s.batch.samples)
            if not budget.fits(stats, model) and not (
                len(s.batch.samples) == 1 and s.batch.oversize
            ):
                raise _Violation(
                    f"BudgetSafety: rank {r} step {s.step}: batch {list(s.batch.ids)} "
                    f"(cost {model.cost(stats):g}, {stats.n} samples, {stats.patches} patches) "
                    f"exceeds budget {budget.tokens} (max_samples={budget.max_samples}, "
                    f"max_patches={budget.max_patches})"
                )
            if (s.local_samples, s.local_tokens, s.local_loss_tokens) != (
                len(s.batch.samples),
                s.batch.tokens,
                s.batch.loss_tokens,
            ):
                raise _Violation(f"ExactLossScaling: rank {r} step {s.step}: local counts disagree")
            sums[t][0] += s.local_samples
            sums[t][1] += s.local_tokens
            sums[t][2] += s.local_loss_tokens
            for sample in s.batch.samples:
                if not 0 <= sample.id < n:
                    raise _Violation(f"TypeOK: unknown sample id {sample.id}")
                delivered[sample.id] += 1
                if delivered[sample.id] > 1:
                    raise _Violation(f"NoDuplicate: sample {sample.id} emitted twice")
        carried.update(s.id for s in res.carried)
        if res.done:
            carried.update(s.id for s in pending[r])
            carried.update(m.unassigned)
            pending[r].clear()
        received[rnd] = received.get(rnd, 0) + 1
        if received[rnd] == world:
            for t, (ls, lt, ll) in enumerate(sums):
                if (ls, lt, ll) != (gs[t], gt[t], gl[t]):
                    raise _Violation(
                        f"ExactLossScaling: round {rnd} step {t}: sum of local ({ls}, {lt}, "
                        f"{ll}) != global ({gs[t]}, {gt[t]}, {gl[t]})"
                    )

    while True:
        if contributed == world and all(x is None for x in inbox):
            gathered = tuple(m.contribution for m in machines)
            if any(c is None for c in gathered):
                raise _Violation("CollectiveAlignment: a rank left the collective it entered")
            for r in range(world):
                inbox[r] = gathered  # type: ignore[assignment]
                runnable.add(r)
            contributed = 0
            actions += 1
            continue
        if not runnable:
            if all(m.phase is RankPhase.DONE for m in machines):
                break
            raise _Violation(
                "DeadlockFreedom: no action enabled; phases "
                f"{sorted({m.phase.value for m in machines})}, {contributed}/{world} contributed"
            )
        iterations += 1
        if actions > limit or iterations > 200 * limit:
            raise _Violation(f"Termination: more than {limit} actions without the epoch ending")
        r = runnable.items[rng.randrange(len(runnable))]
        if rng.random() > sched.speeds[r]:
            continue
        m = machines[r]
        enabled = m.enabled()
        before = actions
        if inbox[r] is not None:
            if RankAction.OBSERVE in enabled and rng.random() < sched.prefetch_prob:
                _observe(m, pending[r])
                actions += 1
            elif rng.random() >= sched.receive_delay:
                receive(r)
                actions += 1
        elif m.phase is RankPhase.FILLING:
            if RankAction.CONTRIBUTE in enabled:
                m.contribute()
                contributed += 1
                actions += 1
            elif RankAction.FORM in enabled:
                m.form()
                actions += 1
            elif RankAction.FORM_EARLY in enabled and rng.random() < 0.5:
                m.form_early()
                actions += 1
            elif RankAction.OBSERVE in enabled:
                if pending[r] or rng.random() >= sched.exhaust_delay:
                    _observe(m, pending[r])
                    actions += 1
            else:
                raise _Violation(f"DeadlockFreedom: rank {r} FILLING with nothing enabled")
        elif RankAction.OBSERVE in enabled and rng.random() < max(sched.prefetch_prob, 0.05):
            _observe(m, pending[r])
            actions += 1
        if actions != before:
            refresh(r)
    # ---- end of epoch checks --------------------------------------------------
    steps = {m.steps for m in machines}
    if len(steps) != 1:
        raise _Violation(f"StepAlignment: ranks ended at different step counts {sorted(steps)}")
    out.steps = steps.pop()
    _check_windows(cfg, buffers, released)
    out.rounds = max(m.round for m in machines)
    out.pads = sum(m.pads for m in machines)
    out.carried = len(carried)
    out.actions = actions
    out.tail = 0 if first_pad_step is None else out.steps - first_pad_step
    if out.steps > out.steps_bound:
        raise _Violation(f"BoundedTermination: {out.steps} steps > bound {out.steps_bound}")
    if out.rounds > out.rounds_bound:
        raise _Violation(f"BoundedTermination: {out.rounds} rounds > bound {out.rounds_bound}")
    if any(pending):
        raise _Violation("TypeOK: samples left in a source after every rank finished")
    if cfg.mode is Mode.JOIN:
        if carried:
            raise _Violation(f"IdentityCoverage: join mode carried {len(carried)} ids")
        missing = [i for i, d in enumerate(delivered) if d != 1]
        if missing:
            raise _Violation(f"IdentityCoverage: ids not emitted exactly once: {missing[:10]}")
    else:
        wrong = [i for i, d in enumerate(delivered) if d + (i in carried) != 1]
        if wrong:
            raise _Violation(f"QuotaClosure: ids neither emitted nor carried once: {wrong[:10]}")
        emitted = sum(delivered)
        met = cfg.quota is not None and emitted >= cfg.quota
        if cfg.dynamic:
            dry = any(m.exhausted for m in machines)
        else:
            dry = any(all(delivered[s.id] for s in shard) for shard in sched.shards)
        if not (met or dry):
            raise _Violation(
                f"QuotaClosure: closed with {emitted} emitted, quota {cfg.quota} unmet, no rank dry"
            )


def _observe(m: RankMachine, pending: list[Sample]) -> None:
    if pending:
        m.observe(pending.pop())
    else:
        m.exhaust()


# ---- campaigns --------------------------------------------------------------------


@dataclass
class FuzzReport:
    schedules: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)
    worst_steps: Outcome | None = None
    worst_rounds: Outcome | None = None
    worst_tail: Outcome | None = None
    max_world: int = 0
    total_samples: int = 0
    total_actions: int = 0
    elapsed_s: float = 0.0
    by_origin: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, o: Outcome) -> None:
        self.schedules += 1
        self.by_origin[o.schedule.origin] = self.by_origin.get(o.schedule.origin, 0) + 1
        self.max_world = max(self.max_world, o.schedule.world)
        self.total_samples += o.schedule.n
        self.total_actions += o.actions
        if not o.ok:
            self.violations.append(o.summary())
            return
        # Worst = closest to the bound; ties go to the larger world, then more steps.
        if self.worst_steps is None or _key(o, "steps") > _key(self.worst_steps, "steps"):
            self.worst_steps = o
        if self.worst_rounds is None or _key(o, "rounds") > _key(self.worst_rounds, "rounds"):
            self.worst_rounds = o
        if self.worst_tail is None or (o.tail, o.schedule.world) > (
            self.worst_tail.tail,
            self.worst_tail.schedule.world,
        ):
            self.worst_tail = o

    def to_json(self) -> dict[str, Any]:
        def worst(o: Outcome | None, key: str) -> dict[str, Any] | None:
            if o is None:
                return None
            s = o.summary()
            return {
                "value": s[key],
                "bound": s.get(f"{key}_bound"),
                "ratio_to_bound": round(_ratio(s[key], s.get(f"{key}_bound", 0)), 4)
                if f"{key}_bound" in s
                else None,
                "schedule": s,
            }

        return {
            "ok": not self.violations,
            "schedules": self.schedules,
            "by_origin": self.by_origin,
            "violations": len(self.violations),
            "violation_examples": self.violations[:10],
            "max_world_size": self.max_world,
            "samples": self.total_samples,
            "actions": self.total_actions,
            "elapsed_s": round(self.elapsed_s, 2),
            "bounds": {
                "steps": "steps <= max samples on any rank (odb_core.protocol.steps_bound)",
                "rounds": "rounds <= steps bound + 1 (odb_core.protocol.rounds_bound)",
            },
            "worst": {
                "steps": worst(self.worst_steps, "steps"),
                "rounds": worst(self.worst_rounds, "rounds"),
                "tail_steps": worst(self.worst_tail, "tail_steps"),
            },
        }


def _key(o: Outcome, what: str) -> tuple[float, int, int]:
    if what == "steps":
        return (_ratio(o.steps, o.steps_bound), o.schedule.world, o.steps)
    return (_ratio(o.rounds, o.rounds_bound), o.schedule.world, o.rounds)


def _ratio(v: int, bound: int) -> float:
    return v / bound if bound else 0.0


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
                target(_ratio(o.steps, o.steps_bound), label="steps / steps_bound")
                target(float(o.steps), label="steps")
            else:
                target(float(o.tail), label="tail steps")
                target(_ratio(o.rounds, o.rounds_bound), label="rounds / rounds_bound")

    search()
    return outcomes


def replay(seed: int, max_ranks: int, machine: type[RankMachine] = RankMachine) -> Outcome:
    return run_schedule(random_schedule(seed, max_ranks), machine)


def worst_cases(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    r = FuzzReport()
    for o in outcomes:
        r.add(o)
    return r.to_json()["worst"]  # type: ignore[no-any-return]
