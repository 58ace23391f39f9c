"""The guarantees of DESIGN.md as predicates on a global model state.

Names match spec/DGAP.tla and proofs/: each function returns None when the
property holds and a short reason when it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from odb_core.assign import dynamic_bounds
from odb_core.collective import decide_round
from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import BatchStats, Budget, CostModel
from odb_core.errors import ODBError
from odb_core.protocol import RankMachine, RankPhase, rounds_bound, steps_bound
from odb_core.sample import Sample
from odb_core.verify.model import GlobalState, ModelConfig

Check = Callable[[GlobalState, ModelConfig], "str | None"]
Counts = tuple[int, int, int]


# ---- the invariants' predicates on plain data ------------------------------------
# Each decides one part of a guarantee from what a driver holds, so the checks on a
# global state below and a driver without one (simulator/fuzz, which checks what W
# rank machines emit) decide it by the same code.


def over_budget(
    samples: Sequence[Sample], oversize: bool, budget: Budget, model: CostModel
) -> bool:
    """BudgetSafety of one batch: it does not fit the budget and is not a single
    sample over the budget alone (the oversize policy's solo batch)."""
    if budget.fits(BatchStats.of(samples), model):
        return False
    return not (len(samples) == 1 and oversize)


def not_exactly_once(delivered: Sequence[int], carried: Collection[int] = ()) -> list[int]:
    """IdentityCoverage and QuotaClosure: the ids that were not emitted, or carried
    to the ledger, exactly once (`delivered[i]`: real emissions of id i)."""
    return [i for i, d in enumerate(delivered) if d + (i in carried) != 1]


def ran_dry(
    delivered: Sequence[int],
    shards: Iterable[Iterable[Sample]],
    exhausted: Iterable[bool],
    dynamic: bool,
) -> bool:
    """QuotaClosure: some rank ran dry. Static: it emitted its whole shard; dynamic:
    it emitted all it was dealt once the plan was dealt out (it found its source
    exhausted)."""
    if dynamic:
        return any(exhausted)
    return any(all(delivered[s.id] for s in shard) for shard in shards)


def quota_closed(emitted: int, quota: int | None, dry: bool) -> bool:
    """QuotaClosure: a quota epoch closes once its global quota is met or a rank ran dry."""
    met = quota is not None and emitted >= quota
    return met or dry


def breaks_window_rule(p: ProtocolConfig, steps: int, loss: int) -> bool:
    """WindowAlignment: an optimizer window that is not the epoch's last closed
    against its rule: after `grad_accum_steps` steps, or at the first step whose
    window's global loss tokens reach `tokens_per_update`."""
    if p.tokens_per_update is not None:
        return loss < p.tokens_per_update
    return steps != p.accum_steps


def summed(counts: Iterable[Counts]) -> Counts:
    """ExactLossScaling: the (samples, cost tokens, loss tokens) of a step summed over
    the ranks' local counts, which its global counts must equal."""
    samples = tokens = loss = 0
    for n, t, lt in counts:
        samples += n
        tokens += t
        loss += lt
    return samples, tokens, loss


def type_ok(state: GlobalState, cfg: ModelConfig) -> str | None:
    w, k = cfg.protocol.world_size, cfg.protocol.buffer_size
    if len(state.ranks) != w or len(state.pending) != w:
        return f"expected {w} ranks"
    for r, rs in enumerate(state.ranks):
        if len(rs.buffer) > k:
            return f"rank {r} buffer holds {len(rs.buffer)} > K={k}"
        if rs.pads > rs.steps or min(rs.steps, rs.pads, rs.round, rs.emitted) < 0:
            return f"rank {r} counters out of range: {rs}"
        if any(len(b.samples) == 0 for b in rs.ready):
            return f"rank {r} has an empty batch in ready"
    if any(d < 0 for d in state.delivered):
        return "negative delivery count"
    return None


def step_alignment(state: GlobalState, cfg: ModelConfig) -> str | None:
    """Ranks that completed the same number of rounds ran the same number of steps."""
    by_round: dict[int, int] = {}
    for rs in state.ranks:
        if by_round.setdefault(rs.round, rs.steps) != rs.steps:
            return (
                f"ranks disagree on the step count after round {rs.round}: "
                f"steps={[r.steps for r in state.ranks]} rounds={[r.round for r in state.ranks]}"
            )
    return None


def collective_alignment(state: GlobalState, cfg: ModelConfig) -> str | None:
    """Ranks are never more than one collective apart, and a rank that is ahead
    has not consumed a round the others have not completed."""
    rounds = [rs.round for rs in state.ranks]
    if max(rounds) - min(rounds) > 1:
        return f"ranks are more than one collective apart: {rounds}"
    return None


def no_duplicate(state: GlobalState, cfg: ModelConfig) -> str | None:
    dup = [i for i, d in enumerate(state.delivered) if d > 1]
    return f"ids emitted more than once: {dup}" if dup else None


def _locations(state: GlobalState, cfg: ModelConfig) -> list[int]:
    count = list(state.delivered)
    for r, rs in enumerate(state.ranks):
        for i in state.pending[r]:
            count[i] += 1
        for s in rs.buffer:
            count[s.id] += 1
        for b in rs.ready:
            for s in b.samples:
                count[s.id] += 1
    for i in state.ledger:
        count[i] += 1
    for i in _undealt(state, cfg):
        count[i] += 1
    return count


def _undealt(state: GlobalState, cfg: ModelConfig) -> list[int]:
    """Dynamic sharding: plan ids no rank holds yet. A rank whose inbox holds the
    gathered round has yet to load its slice of that round's deal: those ids count
    as its pending ones."""
    p = cfg.protocol
    if not p.dynamic or any(rs.phase is RankPhase.DONE for rs in state.ranks):
        return []
    out: list[int] = []
    dealt = max(rs.cursor for rs in state.ranks)
    for r, rs in enumerate(state.ranks):
        gathered = state.inbox[r]
        if gathered is None:
            continue
        # With a cost table the split is priced: by what rank r's machine prices it
        # with (its agreed state: the table and the slices dealt so far).
        pricing = None
        if p.cost_table is not None:
            pricing = cfg.machine.restore(r, p, rs).pricing(gathered)
        d = decide_round(
            p.mode,
            p.quota,
            rs.emitted,
            gathered,
            plan_left=len(p.plan) - rs.cursor,
            target=p.target,
            pricing=pricing,
        )
        # With any_placement every rank loads its slice of the agreed placement.
        assigned = state.placement if d.assigned and state.placement is not None else d.assigned
        start = rs.cursor + sum(assigned[:r])
        out.extend(p.plan[start : start + (assigned[r] if assigned else 0)])
        dealt = max(dealt, rs.cursor + sum(assigned))
    return out + list(p.plan[dealt:])


def no_loss(state: GlobalState, cfg: ModelConfig) -> str | None:
    """Every id is in exactly one place: a source, a buffer, a ready batch,
    delivered once, or in the ledger."""
    count = _locations(state, cfg)
    lost = [i for i, c in enumerate(count) if c == 0]
    extra = [i for i, c in enumerate(count) if c > 1]
    if lost:
        return f"ids lost (in no source, buffer, batch, delivery or ledger): {lost}"
    if extra:
        return f"ids held in two places at once: {extra}"
    return None


def identity_coverage(state: GlobalState, cfg: ModelConfig) -> str | None:
    if cfg.protocol.mode is not Mode.JOIN:
        return None
    if state.ledger:
        return f"join mode carried ids to a ledger: {sorted(state.ledger)}"
    if state.all_done:
        missing = not_exactly_once(state.delivered)
        if missing:
            return f"epoch ended without emitting ids exactly once: {missing}"
    return None


def quota_closure(state: GlobalState, cfg: ModelConfig) -> str | None:
    if cfg.protocol.mode is not Mode.QUOTA or not state.all_done:
        return None
    wrong = not_exactly_once(state.delivered, state.ledger)
    if wrong:
        return f"closed epoch neither emitted nor carried ids exactly once: {wrong}"
    emitted = sum(state.delivered)
    quota = cfg.protocol.quota
    exhausted = (rs.exhausted for rs in state.ranks)
    dry = ran_dry(state.delivered, cfg.shards, exhausted, cfg.protocol.dynamic)
    if not quota_closed(emitted, quota, dry):
        return f"epoch closed with {emitted} samples, quota {quota} unmet and no rank dry"
    counts = state.step_counts[0]
    if quota is not None and counts and emitted - counts[-1][0] >= quota:
        return (
            f"epoch closed late: {emitted - counts[-1][0]} samples had met quota {quota} "
            "before its last step"
        )
    return None


def budget_safety(state: GlobalState, cfg: ModelConfig) -> str | None:
    budget, model = cfg.protocol.budget, cfg.protocol.cost_model
    for r, rs in enumerate(state.ranks):
        for b in rs.ready:
            if not over_budget(b.samples, b.oversize, budget, model):
                continue
            return f"rank {r} formed batch {b.ids} over budget {budget.tokens}"
    return None


def epoch_bounds(cfg: ModelConfig) -> tuple[int, int]:
    """(steps, rounds) bounds of an epoch: max_r N_r (+ 1) in join mode; in quota
    mode no rank pads, so min_r N_r (+ 1) (proofs/bounded_termination.md)."""
    per_rank = cfg.samples_per_rank
    if cfg.protocol.dynamic:
        p = cfg.protocol
        return dynamic_bounds(
            cfg.n_samples, p.world_size, p.configured_target, p.cost_table is not None
        )
    if cfg.protocol.mode is Mode.QUOTA:
        return min(per_rank, default=0), min(per_rank, default=0) + 1
    return steps_bound(per_rank), rounds_bound(per_rank)


def bounded_termination(state: GlobalState, cfg: ModelConfig) -> str | None:
    sb, rb = epoch_bounds(cfg)
    for r, rs in enumerate(state.ranks):
        if rs.steps > sb:
            return f"rank {r} ran {rs.steps} steps > bound {sb}"
        if rs.round > rb:
            return f"rank {r} ran {rs.round} rounds > bound {rb}"
    return None


def termination_agreement(state: GlobalState, cfg: ModelConfig) -> str | None:
    """A rank finishes the epoch only in a round that closes it for every rank:
    each other rank is done too, or holds that same closing round in its inbox."""
    for r, rs in enumerate(state.ranks):
        if rs.phase is not RankPhase.DONE:
            continue
        for s, other in enumerate(state.ranks):
            if other.phase is RankPhase.DONE:
                continue
            if state.inbox[s] is None or other.round != rs.round - 1:
                return (
                    f"rank {r} finished the epoch after round {rs.round} but rank {s} "
                    f"({other.phase.value}, round {other.round}) was not told"
                )
    return None


def exact_loss_scaling(state: GlobalState, cfg: ModelConfig) -> str | None:
    """While a vector is in flight it describes the head of the rank's queue
    (samples, cost tokens, loss tokens), and every rank got what each rank sent;
    so a step's global counts are the sums of the ranks' local ones."""
    for r, rs in enumerate(state.ranks):
        c = rs.contribution
        if c is not None:
            head = rs.ready[: c.offered]
            if c.offered > len(rs.ready) or (
                c.samples != tuple(len(b.samples) for b in head)
                or c.tokens != tuple(b.tokens for b in head)
                or c.loss_tokens != tuple(b.loss_tokens for b in head)
            ):
                return f"rank {r} offered {c} but its queue head is {[b.ids for b in head]}"
        inbox = state.inbox[r]
        if inbox is not None and inbox[r] != c:
            return f"rank {r} received {inbox[r]} as its own vector but sent {c}"
    for r, (batches, counts) in enumerate(zip(state.step_batches, state.step_counts, strict=True)):
        if len(batches) != len(counts):
            return f"rank {r} ran {len(batches)} batches but decided {len(counts)} steps"
        if sum(c[0] for c in counts) != state.ranks[r].emitted:
            return f"rank {r} emitted {state.ranks[r].emitted}, its steps' counts say otherwise"
        for s, other in enumerate(state.step_counts):
            common = min(len(counts), len(other))
            if counts[:common] != other[:common]:
                return f"ranks {r} and {s} decided different global counts"
    observed = _observed(cfg)
    for t in range(min(len(b) for b in state.step_batches)):
        at = [b[t] for b in state.step_batches]
        total = summed(
            (len(b), sum(observed[i].length for i in b), sum(observed[i].loss for i in b))
            for b in at
        )
        if state.step_counts[0][t] != total:
            got = state.step_counts[0][t]
            return f"step {t}: global counts {got} but the batches sum to {total}"
    return None


def _observed(cfg: ModelConfig) -> dict[int, Sample]:
    """Each sample as a rank holds it once observed (the oversize policy applied)."""
    cache: dict[int, Sample] | None = cfg.__dict__.get("_observed")
    if cache is None:
        machine = RankMachine(0, cfg.protocol)
        cache = {}
        for i in range(cfg.n_samples):
            try:
                cache[i] = machine._apply_oversize_policy(cfg.sample(i))
            except ODBError:
                cache[i] = cfg.sample(i)  # refused at observe: never in a batch
        object.__setattr__(cfg, "_observed", cache)
    return cache


def pads_only_at_end(state: GlobalState, cfg: ModelConfig) -> str | None:
    """A rank pads only once it has nothing left (source dry, window and queue
    empty), never in quota mode, and its steps are its batches, then pads."""
    for r, rs in enumerate(state.ranks):
        if rs.pads and not (rs.exhausted and not rs.buffer and not rs.ready):
            return f"rank {r} padded while it still holds samples"
        if rs.pads and cfg.protocol.mode is Mode.QUOTA:
            return f"rank {r} padded in quota mode"
        batches = state.step_batches[r]
        first_pad = next((t for t, b in enumerate(batches) if not b), len(batches))
        if any(batches[first_pad:]):
            return f"rank {r} ran a real batch after a pad (step {first_pad})"
    return None


def deterministic_arrival(state: GlobalState, cfg: ModelConfig) -> str | None:
    """In deterministic mode a rank has consumed a prefix of its shard (with dynamic
    sharding: of what it was dealt, so no id it still waits for precedes, in the
    plan, one it has consumed)."""
    if not cfg.protocol.deterministic:
        return None
    if cfg.protocol.dynamic:
        pos = {i: k for k, i in enumerate(cfg.protocol.plan)}
        for r, rs in enumerate(state.ranks):
            if rs.queue:
                held = {s.id for s in rs.buffer} | {s.id for b in rs.ready for s in b.samples}
                early = [i for i in held if pos[i] > pos[rs.queue[0]]]
                if early:
                    return f"rank {r} consumed {early} before {rs.queue[0]}"
        return None
    for r, shard in enumerate(cfg.shards):
        pending = state.pending[r]
        if pending:
            early = [s.id for s in shard if s.id not in pending and s.id > min(pending)]
            if early:
                return f"rank {r} consumed {early} before {min(pending)}"
    return None


def window_alignment(state: GlobalState, cfg: ModelConfig) -> str | None:
    """Ranks that completed the same rounds closed the same optimizer windows at the
    same steps with the same global loss tokens, and hold the same open window;
    each window's local loss tokens add up over the ranks to its global count (so
    the window's loss scales sum to exactly the global per-token mean); and each
    window closed by its rule (the last one of an epoch may be short)."""
    p = cfg.protocol
    by_round: dict[int, tuple[object, ...]] = {}
    for r, rs in enumerate(state.ranks):
        view = (tuple((w.end, w.loss) for w in rs.windows), rs.window_loss)
        if by_round.setdefault(rs.round, view) != view:
            return f"rank {r} disagrees on the windows after round {rs.round}: {view}"
        for i, w in enumerate(rs.windows):
            start = rs.windows[i - 1].end if i else 0
            last = i == len(rs.windows) - 1 and rs.phase is RankPhase.DONE
            if w.end <= start:
                return f"rank {r} closed an empty window {i}"
            if last or not breaks_window_rule(p, w.end - start, w.loss):
                continue
            if p.tokens_per_update is None:
                return f"rank {r} window {i} ran {w.end - start} steps, not {p.accum_steps}"
            return f"rank {r} window {i} closed at {w.loss} < {p.tokens_per_update} tokens"
    rounds = {rs.round for rs in state.ranks}
    if len(rounds) == 1:
        first = state.ranks[0]
        for i, w in enumerate(first.windows):
            local = sum(rs.windows[i].local for rs in state.ranks)
            if local != w.loss:
                return f"window {i}: ranks' loss tokens add up to {local}, not {w.loss}"
        local = sum(rs.window_local for rs in state.ranks)
        if local != first.window_loss:
            return f"open window: ranks' loss tokens add up to {local}, not {first.window_loss}"
    return None


INVARIANTS: dict[str, Check] = {
    "TypeOK": type_ok,
    "StepAlignment": step_alignment,
    "CollectiveAlignment": collective_alignment,
    "NoDuplicate": no_duplicate,
    "NoLoss": no_loss,
    "IdentityCoverage": identity_coverage,
    "QuotaClosure": quota_closure,
    "BudgetSafety": budget_safety,
    "BoundedTermination": bounded_termination,
    "TerminationAgreement": termination_agreement,
    "ExactLossScaling": exact_loss_scaling,
    "WindowAlignment": window_alignment,
    "PadsOnlyAtEnd": pads_only_at_end,
    "DeterministicArrival": deterministic_arrival,
}
"""Safety invariants checked on every reachable state. DeadlockFreedom and
Termination are properties of the state graph and are checked by the checker."""
