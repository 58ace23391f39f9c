"""The driver: W RankMachines through one schedule, every guarantee checked.

The driver interleaves the ranks' local actions at random under the schedule's
knobs (one action of one rank at a time, as in the global model), fires the
all-gather when every rank has contributed, and lets each rank consume the
gathered round at its own time. It decides nothing: all protocol decisions are
the machines'.

Checked on what the machines emit, each by its spec name: step alignment (every
rank emits the same number of steps in every round and in the epoch),
termination agreement, exact loss normalisation (global counts equal the sum of
local ones), window alignment (every rank releases the same optimizer windows,
each exact), exactly-once coverage (join), quota closure and the ledger (quota),
budget safety, pad accounting, the proven bounds `steps_bound` / `rounds_bound`,
deadlock freedom and termination (no state without an enabled action, bounded
number of actions). The predicates of a guarantee are those of
`odb_core.verify.invariants`, applied to the emitted steps.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from odb_core.assign import dynamic_bounds
from odb_core.collective import Contribution
from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import BatchStats
from odb_core.errors import ODBError
from odb_core.protocol import (
    RankAction,
    RankMachine,
    RankPhase,
    RoundResult,
    rounds_bound,
    steps_bound,
)
from odb_core.sample import Sample
from odb_core.step import StepInfo
from odb_core.verify.invariants import (
    Counts,
    breaks_window_rule,
    not_exactly_once,
    over_budget,
    quota_closed,
    ran_dry,
    summed,
)
from odb_core.window import WindowBuffer
from simulator.fuzz.schedules import Schedule

# What every rank must agree on about a round: (steps, done, global samples, cost
# tokens and loss tokens of each step).
_RoundInfo = tuple[int, bool, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


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


class _Violation(Exception):
    pass


def run_schedule(
    sched: Schedule, machine: type[RankMachine] = RankMachine, max_actions: int | None = None
) -> Outcome:
    """Drive W machines through one schedule and check every guarantee."""
    out = Outcome(sched)
    try:
        _Driver(sched, machine, out, max_actions).run()
    except _Violation as exc:
        out.violations.append(str(exc))
    except ODBError as exc:
        out.violations.append(f"{type(exc).__name__}: {exc}")
    return out


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


class _Driver:
    """One epoch of one schedule: the ranks' sources, the collective, and what the
    ranks emitted so far (each check reads it)."""

    def __init__(
        self,
        sched: Schedule,
        machine_cls: type[RankMachine],
        out: Outcome,
        max_actions: int | None,
    ) -> None:
        cfg, world = sched.config, sched.world
        self.sched, self.cfg, self.world, self.out = sched, cfg, world, out
        self.rng = random.Random(sched.seed ^ 0x5EED)
        self.machines = [machine_cls(r, cfg) for r in range(world)]
        self.buffers = [WindowBuffer(cfg) for _ in range(world)]
        self.released: list[list[StepInfo]] = [[] for _ in range(world)]
        self.pending = [list(reversed(s)) for s in sched.shards]  # pop() = next arrival
        per_rank = [len(s) for s in sched.shards]
        out.steps_bound, out.rounds_bound = steps_bound(per_rank), rounds_bound(per_rank)
        self.by_id = {s.id: s for shard in sched.shards for s in shard}
        if cfg.dynamic:
            # A rank's source is what the core deals it, in order.
            self.pending = [[self.by_id[i] for i in reversed(m.queue)] for m in self.machines]
            out.steps_bound, out.rounds_bound = dynamic_bounds(
                len(cfg.plan), world, cfg.configured_target
            )
        n = sched.n
        self.delivered = [0] * n
        self.carried: set[int] = set()
        self.inbox: list[tuple[Contribution, ...] | None] = [None] * world
        self.contributed = 0
        self.received: dict[int, int] = {}  # round -> ranks that consumed it
        self.round_info: dict[int, _RoundInfo] = {}
        # round -> step -> each rank's local (samples, cost tokens, loss tokens)
        self.local_counts: dict[int, list[list[Counts]]] = {}
        self.first_pad_step: int | None = None
        self.limit = (
            max_actions
            or 50 * (n + world * (out.rounds_bound + 2) * (cfg.buffer_size + 4)) + 10_000
        )
        self.runnable = _Runnable()
        for r in range(world):
            self.runnable.add(r)
        self.actions = 0
        self.iterations = 0

    # ---- the schedule ------------------------------------------------------------

    def run(self) -> None:
        machines, world = self.machines, self.world
        while True:
            if self.contributed == world and all(x is None for x in self.inbox):
                self.gather()
                continue
            if not self.runnable:
                if all(m.phase is RankPhase.DONE for m in machines):
                    break
                raise _Violation(
                    "DeadlockFreedom: no action enabled; phases "
                    f"{sorted({m.phase.value for m in machines})}, "
                    f"{self.contributed}/{world} contributed"
                )
            self.iterations += 1
            if self.actions > self.limit or self.iterations > 200 * self.limit:
                raise _Violation(
                    f"Termination: more than {self.limit} actions without the epoch ending"
                )
            r = self.runnable.items[self.rng.randrange(len(self.runnable))]
            if self.rng.random() > self.sched.speeds[r]:
                continue
            before = self.actions
            self.act(r)
            if self.actions != before:
                self.refresh(r)
        self.close()

    def gather(self) -> None:
        """AllGather: every rank has contributed; each gets the gathered vectors."""
        gathered = tuple(m.contribution for m in self.machines)
        if any(c is None for c in gathered):
            raise _Violation("CollectiveAlignment: a rank left the collective it entered")
        for r in range(self.world):
            self.inbox[r] = gathered  # type: ignore[assignment]
            self.runnable.add(r)
        self.contributed = 0
        self.actions += 1

    def act(self, r: int) -> None:
        """One local action of rank r, as the schedule's knobs pick it."""
        m, rng, sched, pending = self.machines[r], self.rng, self.sched, self.pending[r]
        enabled = m.enabled()
        if self.inbox[r] is not None:
            if RankAction.OBSERVE in enabled and rng.random() < sched.prefetch_prob:
                _observe(m, pending)
                self.actions += 1
            elif rng.random() >= sched.receive_delay:
                self.receive(r)
                self.actions += 1
        elif m.phase is RankPhase.FILLING:
            if RankAction.CONTRIBUTE in enabled:
                m.contribute()
                self.contributed += 1
                self.actions += 1
            elif RankAction.FORM in enabled:
                m.form()
                self.actions += 1
            elif RankAction.FORM_EARLY in enabled and rng.random() < 0.5:
                m.form_early()
                self.actions += 1
            elif RankAction.OBSERVE in enabled:
                if pending or rng.random() >= sched.exhaust_delay:
                    _observe(m, pending)
                    self.actions += 1
            else:
                raise _Violation(f"DeadlockFreedom: rank {r} FILLING with nothing enabled")
        elif RankAction.OBSERVE in enabled and rng.random() < max(sched.prefetch_prob, 0.05):
            _observe(m, pending)
            self.actions += 1

    def refresh(self, r: int) -> None:
        m = self.machines[r]
        if (
            self.inbox[r] is not None
            or m.phase is RankPhase.FILLING
            or (m.phase is RankPhase.WAITING and RankAction.OBSERVE in m.enabled())
        ):
            self.runnable.add(r)
        else:
            self.runnable.discard(r)

    # ---- a rank leaves the collective ------------------------------------------------

    def receive(self, r: int) -> None:
        """Receive(r): rank r consumes the gathered round; its steps are checked."""
        m, out = self.machines[r], self.out
        gathered = self.inbox[r]
        assert gathered is not None
        rnd = m.round
        if rnd + 1 > out.rounds_bound:
            raise _Violation(
                f"BoundedTermination: rank {r} enters round {rnd + 1} > bound {out.rounds_bound}"
            )
        queued = len(m.queue)
        res: RoundResult = m.all_gather(gathered)
        if self.cfg.dynamic:
            self.pending[r][:0] = [self.by_id[i] for i in reversed(list(m.queue)[queued:])]
        if m.steps > out.steps_bound:
            raise _Violation(
                f"BoundedTermination: rank {r} ran {m.steps} steps > bound {out.steps_bound}"
            )
        self.inbox[r] = None
        k = len(res.steps)
        gs = tuple(s.global_samples for s in res.steps)
        gt = tuple(s.global_tokens for s in res.steps)
        gl = tuple(s.global_loss_tokens for s in res.steps)
        self.released[r].extend(self.buffers[r].push(res))
        info = (k, res.done, gs, gt, gl)
        seen = self.round_info.setdefault(rnd, info)
        if seen != info:
            raise _Violation(
                f"StepAlignment: round {rnd}: rank {r} got (steps={k}, done={res.done}) but "
                f"another rank got (steps={seen[0]}, done={seen[1]})"
            )
        counts = self.local_counts.setdefault(rnd, [[] for _ in range(k)])
        for t, s in enumerate(res.steps):
            self.check_step(r, s, counts[t])
        self.carried.update(s.id for s in res.carried)
        if res.done:
            self.carried.update(s.id for s in self.pending[r])
            self.carried.update(m.unassigned)
            self.pending[r].clear()
        self.received[rnd] = self.received.get(rnd, 0) + 1
        if self.received[rnd] == self.world:
            for t, local in enumerate(counts):
                ls, lt, ll = summed(local)
                if (ls, lt, ll) != (gs[t], gt[t], gl[t]):
                    raise _Violation(
                        f"ExactLossScaling: round {rnd} step {t}: sum of local ({ls}, {lt}, "
                        f"{ll}) != global ({gs[t]}, {gt[t]}, {gl[t]})"
                    )

    def check_step(self, r: int, s: StepInfo, counts: list[Counts]) -> None:
        """One emitted step of rank r: pad accounting, budget safety, its local
        counts (kept in `counts` for the round's sums) and its ids."""
        if s.is_pad != (s.batch is None):
            raise _Violation(f"PadAccounting: rank {r} step {s.step}: is_pad={s.is_pad}")
        if s.is_pad:
            if self.first_pad_step is None or s.step < self.first_pad_step:
                self.first_pad_step = s.step
            return
        assert s.batch is not None
        if not s.batch.samples:
            raise _Violation(f"TypeOK: rank {r} step {s.step}: empty real batch")
        budget, model = self.cfg.budget, self.cfg.cost_model
        if over_budget(s.batch.samples, s.batch.oversize, budget, model):
            stats = BatchStats.of(s.batch.samples)
            raise _Violation(
                f"BudgetSafety: rank {r} step {s.step}: batch {list(s.batch.ids)} "
                f"(cost {model.cost(stats):g}, {stats.n} samples, {stats.patches} patches) "
                f"exceeds budget {budget.tokens} (max_samples={budget.max_samples}, "
                f"max_patches={budget.max_patches})"
            )
        local = (s.local_samples, s.local_tokens, s.local_loss_tokens)
        if local != (len(s.batch.samples), s.batch.tokens, s.batch.loss_tokens):
            raise _Violation(f"ExactLossScaling: rank {r} step {s.step}: local counts disagree")
        counts.append(local)
        n = len(self.delivered)
        for sample in s.batch.samples:
            if not 0 <= sample.id < n:
                raise _Violation(f"TypeOK: unknown sample id {sample.id}")
            self.delivered[sample.id] += 1
            if self.delivered[sample.id] > 1:
                raise _Violation(f"NoDuplicate: sample {sample.id} emitted twice")

    # ---- the end of the epoch --------------------------------------------------------

    def close(self) -> None:
        machines, out = self.machines, self.out
        steps = {m.steps for m in machines}
        if len(steps) != 1:
            raise _Violation(f"StepAlignment: ranks ended at different step counts {sorted(steps)}")
        out.steps = steps.pop()
        _check_windows(self.cfg, self.buffers, self.released)
        out.rounds = max(m.round for m in machines)
        out.pads = sum(m.pads for m in machines)
        out.carried = len(self.carried)
        out.actions = self.actions
        out.tail = 0 if self.first_pad_step is None else out.steps - self.first_pad_step
        if out.steps > out.steps_bound:
            raise _Violation(f"BoundedTermination: {out.steps} steps > bound {out.steps_bound}")
        if out.rounds > out.rounds_bound:
            raise _Violation(f"BoundedTermination: {out.rounds} rounds > bound {out.rounds_bound}")
        if any(self.pending):
            raise _Violation("TypeOK: samples left in a source after every rank finished")
        self.check_coverage()

    def check_coverage(self) -> None:
        """IdentityCoverage (join) or QuotaClosure (quota) of the closed epoch."""
        cfg, delivered, carried = self.cfg, self.delivered, self.carried
        if cfg.mode is Mode.JOIN:
            if carried:
                raise _Violation(f"IdentityCoverage: join mode carried {len(carried)} ids")
            missing = not_exactly_once(delivered)
            if missing:
                raise _Violation(f"IdentityCoverage: ids not emitted exactly once: {missing[:10]}")
            return
        wrong = not_exactly_once(delivered, carried)
        if wrong:
            raise _Violation(f"QuotaClosure: ids neither emitted nor carried once: {wrong[:10]}")
        emitted = sum(delivered)
        exhausted = (m.exhausted for m in self.machines)
        dry = ran_dry(delivered, self.sched.shards, exhausted, cfg.dynamic)
        if not quota_closed(emitted, cfg.quota, dry):
            raise _Violation(
                f"QuotaClosure: closed with {emitted} emitted, quota {cfg.quota} unmet, no rank dry"
            )


def _observe(m: RankMachine, pending: list[Sample]) -> None:
    if pending:
        m.observe(pending.pop())
    else:
        m.exhaust()


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
        if not breaks_window_rule(cfg, steps, gl):
            continue
        if cfg.tokens_per_update is not None:
            raise _Violation(f"WindowAlignment: window {w} closed at {gl} loss tokens")
        raise _Violation(f"WindowAlignment: window {w} ran {steps} steps")
