"""Cross-epoch fairness: an id a quota pass carries is emitted by the next pass.

Theorem and proof: proofs/cross_epoch_fairness.md. Two checks here.

`check_passes` explores two passes of the global model. Pass 1 starts with an
empty ledger and runs every schedule; for each distinct ledger it can close
with, pass 2 is planned as the loader plans it (`odb_core.ledger.plan_epoch`:
the ledger dealt round-robin ahead of each rank's split, `ProtocolConfig.carried`
set) and runs every schedule in which a rank observes its carried ids before its
fresh ones (hypothesis H1). On every state of both passes it checks the
invariants of `invariants.py` and DeadlockFreedom; on every state of pass 2:

- `CarriedFirst` (the lemma, as a state shows it): while a carried id of a rank
  waits, each of its steps emitted a batch holding a carried id, and its ready
  batches holding carried ids come before those without;
- `CrossEpochFairness` (the theorem, in the form whose hypothesis is decided
  before the pass, `fair_quota`): when pass 2 closes, every carried id was
  emitted.

`run_passes` drives the rank machines through many passes, planned by the same
ledger functions, for fuzzing and the acceptance figures (emissions per id, ages).
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from odb_core.config import Mode, OversizePolicy, ProtocolConfig
from odb_core.cost import BatchStats, Budget, CostModel, PackedTokens, PaddedTokens
from odb_core.errors import ConfigError
from odb_core.formers import FORMERS, FormerKind
from odb_core.ledger import Ledgers, ages, ledger_ids, plan_epoch
from odb_core.protocol import RankMachine
from odb_core.resume import partition
from odb_core.sample import Sample
from odb_core.step import StepInfo
from odb_core.verify.bugs import BugVariant
from odb_core.verify.checker import CheckReport, check
from odb_core.verify.explore import StateCheck, explore
from odb_core.verify.invariants import INVARIANTS
from odb_core.verify.model import Action, GlobalModel, GlobalState, ModelConfig

FAIRNESS_PROPERTIES = ("CarriedFirst", "CrossEpochFairness")


# ---- the plan of the next pass, and the theorem's hypothesis ----------------


def next_pass(cfg: ModelConfig, ledger: Iterable[int]) -> ModelConfig:
    """The pass after one of `cfg` that closed with `ledger`: each rank's source
    is its share of the ledger, then its split (the same as `cfg`'s) less the
    ledger, as `ODBDataLoader` plans it; the protocol knows the carried ids."""
    carried = frozenset(ledger)
    ledgers = tuple(tuple(s.id for s in shard if s.id in carried) for shard in cfg.shards)
    orders = plan_epoch(ledgers, [[s.id for s in shard] for shard in cfg.shards])
    shards = tuple(tuple(cfg.sample(i) for i in order) for order in orders)
    protocol = replace(cfg.protocol, carried=carried)
    return ModelConfig(protocol, shards, machine=cfg.machine)


def max_batch_samples(samples: Iterable[Sample], budget: Budget, model: CostModel) -> int:
    """An upper bound m on the samples of one batch: the most of the cheapest
    samples that fit the token budget (and `max_samples`) together; at least 1
    (an oversize sample rides alone). Every cost model here is monotone, so no k
    samples cost less than the k cheapest."""
    costs = sorted(samples, key=lambda s: model.cost(BatchStats.single(s)))
    tokens_only = Budget(budget.tokens, budget.max_samples)
    stats, m = BatchStats(), 0
    for s in costs:
        stats = stats.add(s)
        if not tokens_only.fits(stats, model):
            break
        m += 1
    return max(m, 1)


def fair_quota(cfg: ModelConfig) -> bool:
    """Hypothesis H2* of the theorem, decided from the plan of a pass alone:
    with N_r samples on rank r, c = max_r c_r its most carried ids and
    m = `max_batch_samples`,

        Q > sum_r min(N_r, (c - 1) * m)       (the quota is not met before step b)
        ceil(N_r / m) >= c  for every r       (no rank runs dry before step b)

    where b <= c is the steps the carried ids take. A pass of `cfg` that meets
    it runs at least b steps, so (by the lemma) emits every carried id. Without
    a quota only the second line applies."""
    p = cfg.protocol
    if p.mode is not Mode.QUOTA:
        return False
    carried = p.carried
    c = max((sum(1 for s in shard if s.id in carried) for shard in cfg.shards), default=0)
    if c == 0:
        return True
    m = max_batch_samples((s for shard in cfg.shards for s in shard), p.budget, p.cost_model)
    if any(-(-len(shard) // m) < c for shard in cfg.shards):
        return False
    return p.quota is None or p.quota > sum(min(len(sh), (c - 1) * m) for sh in cfg.shards)


# ---- the properties, on one state of a pass ----------------------------------


def carried_first(state: GlobalState, cfg: ModelConfig) -> str | None:
    """The lemma, as far as a state shows it. On every rank: every step so far
    emitted a batch holding a carried id while one of its carried ids waits (so
    it has emitted at least as many carried ids as it ran steps); no ready batch
    holding a carried id follows one without; and once a batch without a carried
    id is ready, no carried id of the rank waits unformed."""
    carried = cfg.protocol.carried
    if not carried:
        return None
    for r, (shard, rs) in enumerate(zip(cfg.shards, state.ranks, strict=True)):
        mine = [s.id for s in shard if s.id in carried]
        late = [i for i in mine if not state.delivered[i]]
        done = len(mine) - len(late)
        if late and rs.steps > done:
            return f"rank {r} ran {rs.steps} steps but emitted {done} carried ids; {late} wait"
        holds = [any(s.id in carried for s in b.samples) for b in rs.ready]
        if any(h and not prev for prev, h in itertools.pairwise(holds)):
            return f"rank {r} readied a batch of carried ids behind one without"
        unformed = [i for i in late if i in state.pending[r]] + [
            s.id for s in rs.buffer if s.id in carried
        ]
        if unformed and not all(holds):
            return f"rank {r} readied a batch without carried ids while {unformed} wait"
    return None


def cross_epoch_fairness(state: GlobalState, cfg: ModelConfig) -> str | None:
    """A closed pass that meets `fair_quota` emitted every carried id."""
    if not state.all_done or not cfg.protocol.carried or not fair_quota(cfg):
        return None
    left = sorted(i for i in cfg.protocol.carried if not state.delivered[i])
    return f"carried ids {left} not emitted by the next pass" if left else None


# ---- the two-pass exploration ----------------------------------------------------


class CarriedFirstArrival(GlobalModel):
    """The global model of a pass whose ranks observe their carried ids before
    their fresh ones (H1: the loader reads a rank's share of the ledger first),
    in any order within each part."""

    def enabled(self, state: GlobalState) -> list[Action]:
        actions = super().enabled(state)
        carried = self.protocol.carried
        if not carried:
            return actions
        hold = [bool(p & carried) for p in state.pending]
        return [
            a
            for a in actions
            if not (a.name == "Observe" and a.rank is not None and hold[a.rank])
            or a.sample in carried
        ]


def check_passes(
    cfg: ModelConfig, *, max_states: int = 500_000, properties: Iterable[str] | None = None
) -> CheckReport:
    """Two passes of `cfg` (a quota-mode model): see the module docstring. The
    report counts the states of both passes (pass 2 once per distinct ledger);
    `terminal_states` counts the closed second passes. `properties` restricts the
    check to the named ones (invariants, DeadlockFreedom, CarriedFirst,
    CrossEpochFairness), as `checker.check` does."""
    if cfg.protocol.mode is not Mode.QUOTA or cfg.protocol.carried:
        raise ConfigError("check_passes needs a quota-mode model that starts with no ledger")
    start, cpu = time.perf_counter(), time.process_time()
    report = CheckReport(
        config={
            **cfg.protocol.describe(),
            "samples": cfg.n_samples,
            "samples_per_rank": list(cfg.samples_per_rank),
            "costs": [cfg.sample(i).length for i in range(cfg.n_samples)],
            "machine": cfg.machine.__name__,
            "passes": 2,
        }
    )
    wanted = set(properties) if properties is not None else None
    invariants = {k: v for k, v in INVARIANTS.items() if wanted is None or k in wanted}
    first = explore(GlobalModel(cfg), cfg, invariants, max_states=max_states)
    report.states, report.edges = len(first.states), first.edge_count
    report.max_steps_seen, report.max_rounds_seen = first.max_steps, first.max_rounds
    report.steps_bound = max(cfg.samples_per_rank)
    report.rounds_bound = report.steps_bound + 1
    report.violations.extend(first.violations)
    report.complete = first.complete
    checks: dict[str, StateCheck] = {
        **invariants,
        **{
            k: v
            for k, v in (
                ("CarriedFirst", carried_first),
                ("CrossEpochFairness", cross_epoch_fairness),
            )
            if wanted is None or k in wanted
        },
    }
    seen: set[frozenset[int]] = set()
    report.config["plans"] = report.config["fair_plans"] = 0
    for n in first.terminals:
        closed = first.states[n]
        if closed.ledger in seen or not closed.ledger:
            continue
        seen.add(closed.ledger)
        cfg2 = next_pass(cfg, closed.ledger)
        report.config["plans"] += 1
        report.config["fair_plans"] += fair_quota(cfg2)
        report.steps_bound = max(report.steps_bound, *cfg2.samples_per_rank)
        report.rounds_bound = report.steps_bound + 1
        turn = f"NextPass({','.join(map(str, sorted(closed.ledger)))})"
        second = explore(
            CarriedFirstArrival(cfg2),
            cfg2,
            checks,
            max_states=max_states - report.states,
            prefix=[*first.trace(n), turn],
        )
        report.states += len(second.states)
        report.edges += second.edge_count
        report.terminal_states += len(second.terminals)
        report.max_steps_seen = max(report.max_steps_seen, second.max_steps)
        report.max_rounds_seen = max(report.max_rounds_seen, second.max_rounds)
        report.complete &= second.complete
        have = report.violated()
        report.violations.extend(v for v in second.violations if v.property not in have)
        if not report.complete:
            break
    report.elapsed_s = time.perf_counter() - start
    report.cpu_s = time.process_time() - cpu
    return report


# ---- many passes of the rank machines -------------------------------------------


@dataclass
class PassRecord:
    """One pass: what it started with and what it emitted and carried."""

    carried_in: frozenset[int]
    emitted: frozenset[int]
    steps: int
    carried_batches: tuple[int, ...]  # per rank: b_r, the batches its carried ids form
    carried_steps: tuple[int, ...]  # per rank: steps whose batch held a carried id
    ledgers: Ledgers
    ages: dict[int, int]  # of the ids this pass carried out
    carried_first: bool  # no rank emitted a fresh id before its last carried one

    @property
    def hypothesis(self) -> bool:
        """H2: the pass ran at least b = max_r b_r steps."""
        return self.steps >= max(self.carried_batches, default=0)

    @property
    def fair(self) -> bool:
        """The theorem on this pass: H2 implies every carried id was emitted."""
        return not self.hypothesis or self.carried_in <= self.emitted


@dataclass
class PassesReport:
    samples: int
    records: list[PassRecord]

    @property
    def counts(self) -> Counter[int]:
        c: Counter[int] = Counter({i: 0 for i in range(self.samples)})
        for rec in self.records:
            c.update(rec.emitted)
        return c

    @property
    def max_age(self) -> int:
        """The most passes in a row an id was carried (the theorem: at most 1)."""
        return max((a for rec in self.records for a in rec.ages.values()), default=0)

    @property
    def never_emitted(self) -> list[int]:
        return sorted(i for i, n in self.counts.items() if n == 0)

    def passes_until_all_emitted(self) -> int | None:
        seen: set[int] = set()
        for p, rec in enumerate(self.records, 1):
            seen |= rec.emitted
            if len(seen) == self.samples:
                return p
        return None

    @property
    def fair(self) -> bool:
        """Every pass kept the lemma and, where it met H2, the theorem."""
        return all(rec.carried_first and rec.fair for rec in self.records)

    def missed(self) -> list[tuple[int, list[int]]]:
        """(pass, carried ids it did not emit), for passes that missed any."""
        out = []
        for p, rec in enumerate(self.records, 1):
            left = sorted(rec.carried_in - rec.emitted)
            if left:
                out.append((p, left))
        return out


def carried_batches(protocol: ProtocolConfig, order: Sequence[Sample]) -> int:
    """b_r: the batches that hold rank r's carried ids, read in `order` (carried
    first). A window of K carried ids is formed as usual, its leftovers lead the
    next; the window that holds the last of them seals what is left (flushed)."""
    k, former = protocol.buffer_size, FORMERS[protocol.former]
    budget, model = protocol.budget, protocol.cost_model
    window: list[Sample] = []
    b = 0
    for s in order:
        if s.id not in protocol.carried:
            break
        window.append(s)
        if len(window) == k:
            out = former(window, budget, model, False)
            b += len(out.batches)
            window = list(out.leftovers)
    if window:
        b += len(former(window, budget, model, True).batches)
    return b


def run_pass(
    protocol: ProtocolConfig,
    orders: Sequence[Sequence[Sample]],
    machine: type[RankMachine] = RankMachine,
) -> tuple[list[list[StepInfo]], Ledgers]:
    """One pass of W rank machines in lockstep rounds, each reading its `order`.
    Returns every rank's steps and ledger (what it did not emit, in its order)."""
    machines = [machine(r, protocol) for r in range(protocol.world_size)]
    queues = [deque(order) for order in orders]
    steps: list[list[StepInfo]] = [[] for _ in machines]
    while True:
        vectors = [
            m.fill(lambda q=q: q.popleft() if q else None)  # type: ignore[misc]
            for m, q in zip(machines, queues, strict=True)
        ]
        done = False
        for r, m in enumerate(machines):
            result = m.all_gather(vectors)
            steps[r].extend(result.steps)
            done = result.done
        if done:
            break
    ledgers = []
    for r, order in enumerate(orders):
        emitted = {i for info in steps[r] for i in info.sample_ids}
        ledgers.append(tuple(s.id for s in order if s.id not in emitted))
    return steps, tuple(ledgers)


def run_passes(
    costs: Sequence[int],
    protocol: ProtocolConfig,
    passes: int,
    *,
    seed: int = 0,
    machine: type[RankMachine] = RankMachine,
    shuffle_within: bool = False,
) -> PassesReport:
    """`passes` quota passes over samples of the given costs, planned as the
    loader plans them: a fresh random order each pass, split round-robin, the
    last pass's ledger dealt ahead of it (`plan_epoch`). `shuffle_within`
    shuffles each rank's carried head and fresh tail apart (any order H1 allows)."""
    rng = random.Random(seed)
    samples = [Sample(i, c) for i, c in enumerate(costs)]
    world = protocol.world_size
    ledgers: Ledgers = ()
    age: dict[int, int] = {}
    records = []
    for _ in range(passes):
        order = list(range(len(samples)))
        rng.shuffle(order)
        carried = frozenset(ledger_ids(ledgers))
        plan = plan_epoch(ledgers, [partition(order, world, r) for r in range(world)])
        if shuffle_within:
            for ids in plan:
                head = [i for i in ids if i in carried]
                tail = ids[len(head) :]
                rng.shuffle(head)
                rng.shuffle(tail)
                ids[:] = head + tail
        config = replace(protocol, carried=carried)
        orders = [[samples[i] for i in ids] for ids in plan]
        bound = tuple(carried_batches(config, o) for o in orders)
        steps, ledgers = run_pass(config, orders, machine)
        age = ages(ledgers, age)
        emitted = frozenset(i for rank in steps for info in rank for i in info.sample_ids)
        marks = [[any(i in carried for i in info.sample_ids) for info in rank] for rank in steps]
        first = all(
            not any(m[j] and not m[j - 1] for j in range(1, len(m)))
            and (not any(i in carried for i in led) or all(m))
            for m, led in zip(marks, ledgers, strict=True)
        )
        records.append(
            PassRecord(
                carried,
                emitted,
                len(steps[0]),
                bound,
                tuple(sum(m) for m in marks),
                ledgers,
                age,
                first,
            )
        )
    return PassesReport(len(samples), records)


def random_quota_config(rng: random.Random) -> tuple[list[int], ProtocolConfig]:
    """A random quota-mode setting: 1-3 ranks, long-tail costs (some over the
    budget, riding alone), any former and cost model, a quota or none."""
    world = rng.randint(1, 3)
    n = rng.randint(6, 160)
    budget = rng.choice((32, 64, 128, 512))
    costs = [
        max(1, min(2 * budget, int(rng.lognormvariate(0, 1.1) * budget / 8))) for _ in range(n)
    ]
    protocol = ProtocolConfig(
        world_size=world,
        budget=Budget(budget, max_samples=rng.choice((None, None, 4))),
        cost_model=rng.choice((PackedTokens(), PaddedTokens())),
        buffer_size=rng.randint(1, 24),
        mode=Mode.QUOTA,
        former=rng.choice(tuple(FormerKind)),
        oversize=OversizePolicy.SOLO,
        max_steps_per_round=rng.randint(1, 5),
        quota=rng.choice((None, rng.randint(max(1, n // 4), n))),
    )
    return costs, protocol


def fuzz_passes(
    configs: int, seed: int, *, passes: int = 8, machine: type[RankMachine] = RankMachine
) -> tuple[list[dict[str, object]], int, int]:
    """`passes` passes of `configs` random settings (`random_quota_config`).
    Returns the failures (a pass that broke CarriedFirst, met H2 and still
    carried an id again, or emitted its carried ids in other than b_r steps),
    the passes that started with carried ids, and how many of those met H2."""
    failures: list[dict[str, object]] = []
    carrying = held = 0
    for j in range(configs):
        rng = random.Random(seed * 1_000_003 + j)
        costs, protocol = random_quota_config(rng)
        report = run_passes(
            costs,
            protocol,
            passes,
            seed=rng.randrange(1 << 30),
            machine=machine,
            shuffle_within=rng.random() < 0.5,
        )
        for p, rec in enumerate(report.records, 1):
            if rec.carried_in:
                carrying += 1
                held += rec.hypothesis
            exact = not rec.carried_in <= rec.emitted or rec.carried_steps == rec.carried_batches
            if not (rec.carried_first and rec.fair and exact):
                failures.append(
                    {
                        "config": j,
                        "pass": p,
                        "carried_first": rec.carried_first,
                        "not_emitted": sorted(rec.carried_in - rec.emitted),
                        "steps": rec.steps,
                        "carried_batches": rec.carried_batches,
                    }
                )
                break
    return failures, carrying, held


def check_variant(bug: BugVariant, *, max_states: int = 300_000) -> CheckReport:
    """The check that must catch `bug` on its small model: both passes for a
    cross-epoch variant, else the explicit-state checker on the named property."""
    if bug.passes > 1:
        return check_passes(bug.model(), max_states=max_states, properties=[bug.violates])
    return check(bug.model(), properties=[bug.violates], max_states=max_states)


def long_tail(n: int, seed: int, budget: int = 4096) -> list[int]:
    """Costs 16..budget, log-normal (median about 245): the issue's setting."""
    rng = random.Random(seed)
    return [min(budget, max(16, int(rng.lognormvariate(5.5, 1.0)))) for _ in range(n)]


def issue_setting(passes: int = 8) -> list[dict[str, object]]:
    """The figures of proofs/cross_epoch_fairness.md: 600 long-tail samples,
    budget 4096, K = 64, quota 400, W = 1..3, `passes` passes, the old former
    (CARRY_NOT_FIRST) against the core's. `python -m odb_core.verify.fairness`."""
    rows: list[dict[str, object]] = []
    for world in (1, 2, 3):
        costs = long_tail(600, world)
        protocol = ProtocolConfig(
            world_size=world, budget=Budget(4096), buffer_size=64, mode=Mode.QUOTA, quota=400
        )
        shortest = sorted(range(600), key=lambda i: (costs[i], i))[:10]
        for name, machine in (("old", BugVariant.CARRY_NOT_FIRST.machine), ("core", RankMachine)):
            r = run_passes(costs, protocol, passes, seed=world, machine=machine)
            counts, later = r.counts, r.records[1:]
            fill = [
                sum(costs[i] for i in rec.emitted) / (rec.steps * world * 4096) for rec in later
            ]
            rows.append(
                {
                    "W": world,
                    "former": name,
                    "never_emitted": len(r.never_emitted),
                    "max_age": r.max_age,
                    "all_emitted_by_pass": r.passes_until_all_emitted(),
                    "carried_in_emitted": [len(x.carried_in & x.emitted) for x in later],
                    "carried_in": [len(x.carried_in) for x in later],
                    "shortest10_emissions": [counts[i] for i in shortest],
                    "mean_emissions": round(sum(counts.values()) / 600, 2),
                    "steps": [x.steps for x in later],
                    "b": [max(x.carried_batches) for x in later],
                    "mean_fill": round(sum(fill) / len(fill), 3),
                }
            )
    return rows


if __name__ == "__main__":
    import json

    for row in issue_setting():
        print(json.dumps(row))
