"""Breadth-first exploration of the global model: the one search the checker
(`checker.check`, one pass) and the cross-epoch check (`fairness.check_passes`,
two passes) both run.

Every reached state is checked against the given state checks; a state that
violates one is not expanded (keeps broken models finite). A state with no
successor is terminal when every rank is done, a deadlock otherwise. Each
violation comes back once per property, with the shortest trace of action
labels to it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from odb_core.errors import ODBError
from odb_core.verify.model import GlobalModel, GlobalState, ModelConfig

StateCheck = Callable[[GlobalState, ModelConfig], "str | None"]


@dataclass
class Violation:
    property: str
    reason: str
    trace: list[str]
    state: GlobalState

    def to_json(self) -> dict[str, Any]:
        return {
            "property": self.property,
            "reason": self.reason,
            "trace": self.trace,
            "state": describe_state(self.state),
        }


@dataclass
class Exploration:
    """What one search reached: states by index, the edge to each from its BFS
    parent, every edge when kept, and the terminal and deadlocked states."""

    prefix: list[str]
    states: list[GlobalState] = field(default_factory=list)
    parent: list[tuple[int, str]] = field(default_factory=list)
    edges: list[tuple[int, int, str]] = field(default_factory=list)
    edge_count: int = 0
    terminals: list[int] = field(default_factory=list)
    deadlocks: list[int] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    complete: bool = True
    max_steps: int = 0
    max_rounds: int = 0

    def trace(self, n: int) -> list[str]:
        """The action labels from the initial state to state `n`, after `prefix`."""
        labels: list[str] = []
        while self.parent[n][0] >= 0:
            labels.append(self.parent[n][1])
            n = self.parent[n][0]
        return self.prefix + labels[::-1]

    def record(self, prop: str, reason: str, n: int) -> None:
        """A violation of `prop` at state `n`, kept if `prop` has none yet."""
        if all(v.property != prop for v in self.violations):
            self.violations.append(Violation(prop, reason, self.trace(n), self.states[n]))


def describe_state(state: GlobalState) -> dict[str, Any]:
    """Readable, spec-named view of a global state."""
    return {
        "phase": [rs.phase.value for rs in state.ranks],
        "exhausted": [rs.exhausted for rs in state.ranks],
        "pending": [sorted(p) for p in state.pending],
        "buffer": [[s.id for s in rs.buffer] for rs in state.ranks],
        "ready": [[list(b.ids) for b in rs.ready] for rs in state.ranks],
        "steps": [rs.steps for rs in state.ranks],
        "pads": [rs.pads for rs in state.ranks],
        "round": [rs.round for rs in state.ranks],
        "inbox": [i is not None for i in state.inbox],
        "delivered": list(state.delivered),
        "ledger": sorted(state.ledger),
    }


def explore(
    model: GlobalModel,
    cfg: ModelConfig,
    checks: Mapping[str, StateCheck],
    *,
    max_states: int,
    prefix: list[str] | None = None,
    deadlock_freedom: bool = True,
    keep_edges: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Exploration:
    """Every state of `model` reachable from its initial states, up to
    `max_states` (then `complete` is False). `deadlock_freedom` records a
    deadlocked state as a DeadlockFreedom violation (it is counted either way)."""
    inits = model.inits()
    out = Exploration(prefix=list(prefix or []), states=inits, parent=[(-1, "")] * len(inits))
    index: dict[GlobalState, int] = {s: n for n, s in enumerate(inits)}
    frontier: deque[int] = deque(range(len(inits)))
    while frontier:
        n = frontier.popleft()
        s = out.states[n]
        out.max_steps = max(out.max_steps, max(r.steps for r in s.ranks))
        out.max_rounds = max(out.max_rounds, max(r.round for r in s.ranks))
        bad = False
        for name, check in checks.items():
            reason = check(s, cfg)
            if reason is not None:
                out.record(name, reason, n)
                bad = True
        if bad:
            continue
        try:
            succ = list(model.successors(s))
        except ODBError as exc:
            out.record(type(exc).__name__, str(exc), n)
            continue
        if not succ:
            if s.all_done:
                out.terminals.append(n)
            else:
                out.deadlocks.append(n)
                if deadlock_freedom:
                    out.record("DeadlockFreedom", "no action enabled and not all ranks done", n)
        for action, t in succ:
            m = index.get(t)
            if m is None:
                m = len(out.states)
                index[t] = m
                out.states.append(t)
                out.parent.append((n, action.label))
                frontier.append(m)
            out.edge_count += 1
            if keep_edges:
                out.edges.append((n, m, action.label))
        if len(out.states) > max_states:
            out.complete = False
            break
        if progress is not None and n and n % 50_000 == 0:
            progress(n)
    return out
