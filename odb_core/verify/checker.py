"""Explicit-state checker: breadth-first search over the global model.

Every reachable state is checked against `INVARIANTS`; the state graph (a
networkx MultiDiGraph labelled with action names) is then checked for
DeadlockFreedom (every state without successors has all ranks done) and
Termination (the graph is acyclic, so every schedule ends, and its longest
path is reported). Counterexamples come back as the shortest trace of action
labels from the initial state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from odb_core.verify.explore import Violation, describe_state, explore
from odb_core.verify.invariants import INVARIANTS, epoch_bounds
from odb_core.verify.model import GlobalModel, ModelConfig

GRAPH_PROPERTIES = ("DeadlockFreedom", "Termination")
PROPERTIES = (*INVARIANTS, *GRAPH_PROPERTIES)
__all__ = ["PROPERTIES", "CheckReport", "Violation", "check", "describe_state"]


@dataclass
class CheckReport:
    config: dict[str, Any]
    states: int = 0
    edges: int = 0
    terminal_states: int = 0
    deadlocks: int = 0
    max_steps_seen: int = 0
    max_rounds_seen: int = 0
    steps_bound: int = 0
    rounds_bound: int = 0
    longest_schedule: int = 0
    acyclic: bool = True
    complete: bool = True
    elapsed_s: float = 0.0
    cpu_s: float = 0.0
    violations: list[Violation] = field(default_factory=list)
    graph: nx.MultiDiGraph[int] | None = None

    @property
    def ok(self) -> bool:
        return self.complete and not self.violations

    @property
    def states_per_s(self) -> float:
        # CPU time, not wall time: these machines are shared and noisy.
        return self.states / self.cpu_s if self.cpu_s > 0 else 0.0

    def violated(self) -> set[str]:
        return {v.property for v in self.violations}

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": "python",
            "ok": self.ok,
            "config": self.config,
            "states": self.states,
            "edges": self.edges,
            "terminal_states": self.terminal_states,
            "deadlocks": self.deadlocks,
            "max_steps_seen": self.max_steps_seen,
            "max_rounds_seen": self.max_rounds_seen,
            "steps_bound": self.steps_bound,
            "rounds_bound": self.rounds_bound,
            "longest_schedule": self.longest_schedule,
            "acyclic": self.acyclic,
            "complete": self.complete,
            "elapsed_s": round(self.elapsed_s, 3),
            "cpu_s": round(self.cpu_s, 3),
            "states_per_s": round(self.states_per_s),
            "violations": [v.to_json() for v in self.violations],
        }


def check(
    cfg: ModelConfig,
    *,
    max_states: int = 2_000_000,
    keep_graph: bool = False,
    properties: Iterable[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> CheckReport:
    """Explore every reachable state of `cfg` (up to `max_states`).

    `properties` restricts the check to the named invariants and graph properties
    (DeadlockFreedom, Termination), as a TLC config lists the ones it checks; by
    default all are checked. States that violate a checked invariant are not
    expanded further.
    """
    wanted = set(properties) if properties is not None else set(PROPERTIES)
    unknown = wanted - set(PROPERTIES)
    if unknown:
        raise ValueError(f"unknown properties {sorted(unknown)}; known: {sorted(PROPERTIES)}")
    invariants = {k: v for k, v in INVARIANTS.items() if k in wanted}
    model = GlobalModel(cfg)
    report = CheckReport(config=_describe_config(cfg))
    report.steps_bound, report.rounds_bound = epoch_bounds(cfg)
    start = time.perf_counter()
    cpu_start = time.process_time()
    run = explore(
        model,
        cfg,
        invariants,
        max_states=max_states,
        deadlock_freedom="DeadlockFreedom" in wanted,
        keep_edges=True,
        progress=progress,
    )
    states, edges = run.states, run.edges
    report.max_steps_seen, report.max_rounds_seen = run.max_steps, run.max_rounds
    report.terminal_states, report.deadlocks = len(run.terminals), len(run.deadlocks)
    report.complete = run.complete
    graph: nx.MultiDiGraph[int] = nx.MultiDiGraph()
    graph.add_nodes_from(range(len(states)))
    for u, v, label in edges:
        graph.add_edge(u, v, key=label)
    report.states = graph.number_of_nodes()
    report.edges = graph.number_of_edges()
    if report.complete:
        try:
            order = list(nx.topological_sort(graph))
        except nx.NetworkXUnfeasible:
            report.acyclic = False
            if "Termination" in wanted:
                cycle = nx.find_cycle(graph)
                run.record("Termination", "a schedule can run forever", cycle[0][0])
        else:
            report.longest_schedule = _longest_path(order, edges, len(states))
    report.violations = run.violations
    report.elapsed_s = time.perf_counter() - start
    report.cpu_s = time.process_time() - cpu_start
    if keep_graph:
        nx.set_node_attributes(graph, dict(enumerate(states)), "state")
        report.graph = graph
    return report


def _longest_path(order: list[int], edges: list[tuple[int, int, str]], n: int) -> int:
    """Length of the longest schedule, by dynamic programming over a topological order."""
    out: list[list[int]] = [[] for _ in range(n)]
    for u, v, _ in edges:
        out[u].append(v)
    depth = [0] * n
    for u in order:
        du = depth[u] + 1
        for v in out[u]:
            if depth[v] < du:
                depth[v] = du
    return max(depth, default=0)


def _describe_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **cfg.protocol.describe(),
        "samples": cfg.n_samples,
        "samples_per_rank": list(cfg.samples_per_rank),
        "costs": [cfg.sample(i).length for i in range(cfg.n_samples)],
        "machine": cfg.machine.__name__,
    }
