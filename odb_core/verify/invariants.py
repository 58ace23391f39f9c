"""The guarantees of DESIGN.md as predicates on a global model state.

Names match spec/DGAP.tla and proofs/: each function returns None when the
property holds and a short reason when it does not.
"""

from __future__ import annotations

from collections.abc import Callable

from odb_core.config import Mode
from odb_core.cost import BatchStats
from odb_core.protocol import RankPhase, rounds_bound, steps_bound
from odb_core.verify.model import GlobalState, ModelConfig

Check = Callable[[GlobalState, ModelConfig], "str | None"]


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


def _locations(state: GlobalState) -> list[int]:
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
    return count


def no_loss(state: GlobalState, cfg: ModelConfig) -> str | None:
    """Every id is in exactly one place: a source, a buffer, a ready batch,
    delivered once, or in the ledger."""
    count = _locations(state)
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
        missing = [i for i, d in enumerate(state.delivered) if d != 1]
        if missing:
            return f"epoch ended without emitting ids exactly once: {missing}"
    return None


def quota_closure(state: GlobalState, cfg: ModelConfig) -> str | None:
    if cfg.protocol.mode is not Mode.QUOTA or not state.all_done:
        return None
    wrong = [i for i, d in enumerate(state.delivered) if d + (1 if i in state.ledger else 0) != 1]
    if wrong:
        return f"closed epoch neither emitted nor carried ids exactly once: {wrong}"
    emitted = sum(state.delivered)
    quota = cfg.protocol.quota
    met = quota is not None and emitted >= quota
    dry = any(all(state.delivered[s.id] for s in shard) for shard in cfg.shards)
    if not (met or dry):
        return f"epoch closed with {emitted} samples, quota {quota} unmet and no rank dry"
    return None


def budget_safety(state: GlobalState, cfg: ModelConfig) -> str | None:
    budget, model = cfg.protocol.budget, cfg.protocol.cost_model
    for r, rs in enumerate(state.ranks):
        for b in rs.ready:
            if budget.fits(BatchStats.of(b.samples), model):
                continue
            if len(b.samples) == 1 and b.oversize:
                continue
            return f"rank {r} formed batch {b.ids} over budget {budget.tokens}"
    return None


def bounded_termination(state: GlobalState, cfg: ModelConfig) -> str | None:
    sb, rb = steps_bound(cfg.samples_per_rank), rounds_bound(cfg.samples_per_rank)
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
            if last:
                continue
            if p.tokens_per_update is None and w.end - start != p.accum_steps:
                return f"rank {r} window {i} ran {w.end - start} steps, not {p.accum_steps}"
            if p.tokens_per_update is not None and w.loss < p.tokens_per_update:
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
}
"""Safety invariants checked on every reachable state. DeadlockFreedom and
Termination are properties of the state graph and are checked by the checker."""
