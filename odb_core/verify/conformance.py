"""State-graph conformance: spec/DGAP.tla (as TLC explores it) vs the Python model.

TLC's `-dump dot,actionlabels` graph is parsed into a networkx MultiDiGraph
whose nodes carry the state (TLC's printed values, parsed) and whose edge keys
are action names. Both graphs are mapped to one canonical form per state (the
spec's variables, per rank, batches as id sets) and compared: the same set of
states and the same multiset of (source, target, action name) edges. TLC labels
edges with the action's name only, so Python's `Observe(0,3)` becomes `Observe`;
the target state still tells which sample arrived. `Terminating`, the spec's
stuttering step at the end of an epoch, has no Python counterpart and is dropped.
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from odb_core.collective import Contribution
from odb_core.sample import Sample
from odb_core.trace import ProtocolTrace, TracingRankMachine
from odb_core.verify.checker import check
from odb_core.verify.model import GlobalState, ModelConfig
from odb_core.verify.tlc import FrozenMap, ModelValue, action_name, parse_state

#: The spec's variables, in the order of a canonical state.
VARIABLES = (
    "phase",
    "exhausted",
    "buffer",
    "ready",
    "steps",
    "pads",
    "round",
    "emitted",
    "contribution",
    "window_loss",
    "window_local",
    "windows",
    "pending",
    "inbox",
    "delivered",
    "ledger",
    "step_batches",
    "step_counts",
    "cursor",
    "formed",
    "placement",
)

Canon = tuple[Hashable, ...]
ContribCanon = (
    tuple[int, bool, tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int, int] | None
)
WindowCanon = tuple[tuple[int, int, int], ...]

_NODE = re.compile(r'^(-?\d+) \[label="((?:[^"\\]|\\.)*)"')
_EDGE = re.compile(r'^(-?\d+) -> (-?\d+) \[label="((?:[^"\\]|\\.)*)"')
_STUTTER_ACTIONS = frozenset({"Terminating"})


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def parse_dot(path: str | Path) -> nx.MultiDiGraph[str]:
    """TLC's dot dump as a MultiDiGraph: node = TLC fingerprint, attribute `state`
    (a dict of parsed values), edge key = action name; `init` marks initial states."""
    graph: nx.MultiDiGraph[str] = nx.MultiDiGraph()
    with open(path) as fh:
        for line in fh:
            m = _EDGE.match(line)
            if m:
                graph.add_edge(m.group(1), m.group(2), key=action_name(_unescape(m.group(3))))
                continue
            m = _NODE.match(line)
            if m:
                state = parse_state(_unescape(m.group(2)))
                graph.add_node(m.group(1), state=state, init="style = filled" in line)
    return graph


# ---- canonical states --------------------------------------------------------


def _per_key(f: Any) -> tuple[Any, ...]:
    if isinstance(f, FrozenMap):
        return tuple(f[k] for k in sorted(f))
    if isinstance(f, tuple):
        return f
    raise ValueError(f"expected a function over 0..n-1, got {f!r}")


def _tlc_contribution(c: Any) -> ContribCanon:
    if isinstance(c, ModelValue):
        return None
    return (
        int(c["offered"]),
        bool(c["final"]),
        tuple(_per_key(c["samples"])),
        tuple(_per_key(c["tokens"])),
        tuple(_per_key(c["loss_tokens"])),
        int(c["unread"]),
        int(c["held"]),
        int(c["held_work"]),
    )


def _tlc_windows(ws: Any) -> WindowCanon:
    return tuple((int(w["end"]), int(w["loss"]), int(w["local"])) for w in _per_key(ws))


def canonical_tlc(state: Mapping[str, Any]) -> Canon:
    """A TLC state (parsed values by variable name) in canonical form."""
    inbox = tuple(
        None if isinstance(i, ModelValue) else tuple(_tlc_contribution(c) for c in _per_key(i))
        for i in _per_key(state["inbox"])
    )
    return (
        tuple(_per_key(state["phase"])),
        tuple(_per_key(state["exhausted"])),
        tuple(frozenset(b) for b in _per_key(state["buffer"])),
        tuple(tuple(frozenset(b) for b in q) for q in _per_key(state["ready"])),
        tuple(_per_key(state["steps"])),
        tuple(_per_key(state["pads"])),
        tuple(_per_key(state["round"])),
        tuple(_per_key(state["emitted"])),
        tuple(_tlc_contribution(c) for c in _per_key(state["contribution"])),
        tuple(_per_key(state["window_loss"])),
        tuple(_per_key(state["window_local"])),
        tuple(_tlc_windows(ws) for ws in _per_key(state["windows"])),
        tuple(frozenset(p) for p in _per_key(state["pending"])),
        inbox,
        tuple(_per_key(state["delivered"])),
        frozenset(state["ledger"]),
        tuple(tuple(frozenset(b) for b in q) for q in _per_key(state["step_batches"])),
        tuple(tuple(tuple(int(x) for x in c) for c in q) for q in _per_key(state["step_counts"])),
        tuple(_per_key(state["cursor"])),
        tuple(_per_key(state["formed"])),
        _tlc_placement(state.get("placement")),
    )


def _tlc_placement(p: Any) -> tuple[int, ...] | None:
    """The spec's placement: NoValue (or a module without it) is None."""
    if p is None or isinstance(p, ModelValue):
        return None
    return tuple(int(x) for x in _per_key(p))


def _py_contribution(c: Contribution | None) -> ContribCanon:
    if c is None:
        return None
    return (
        c.offered,
        c.final,
        tuple(c.samples),
        tuple(c.tokens),
        tuple(c.loss_tokens),
        c.unread,
        c.held,
        c.held_work,
    )


def canonical_python(state: GlobalState) -> Canon:
    """A Python model state in the same canonical form."""
    rs = state.ranks
    return (
        tuple(r.phase.value for r in rs),
        tuple(r.exhausted for r in rs),
        tuple(frozenset(s.id for s in r.buffer) for r in rs),
        tuple(tuple(frozenset(b.ids) for b in r.ready) for r in rs),
        tuple(r.steps for r in rs),
        tuple(r.pads for r in rs),
        tuple(r.round for r in rs),
        tuple(r.emitted for r in rs),
        tuple(_py_contribution(r.contribution) for r in rs),
        tuple(r.window_loss for r in rs),
        tuple(r.window_local for r in rs),
        tuple(tuple((w.end, w.loss, w.local) for w in r.windows) for r in rs),
        tuple(frozenset(p) for p in state.pending),
        tuple(None if i is None else tuple(_py_contribution(c) for c in i) for i in state.inbox),
        tuple(state.delivered),
        frozenset(state.ledger),
        state.step_batches,
        state.step_counts,
        tuple(r.cursor for r in rs),
        tuple(r.formed for r in rs),
        state.placement,
    )


def describe_canon(c: Canon) -> dict[str, Any]:
    """A canonical state as readable, JSON-friendly data."""

    def plain(v: Any) -> Any:
        if isinstance(v, frozenset):
            return sorted(v)
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    return {name: plain(v) for name, v in zip(VARIABLES, c, strict=True)}


# ---- comparison ----------------------------------------------------------------


@dataclass
class ConformanceReport:
    name: str
    tlc_states: int
    python_states: int
    tlc_edges: int
    python_edges: int
    dropped_stutter_edges: int = 0
    only_in_tlc: list[dict[str, Any]] = field(default_factory=list)
    only_in_python: list[dict[str, Any]] = field(default_factory=list)
    edge_diff: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def equal(self) -> bool:
        return (
            self.tlc_states == self.python_states
            and self.tlc_edges == self.python_edges
            and not self.only_in_tlc
            and not self.only_in_python
            and not self.edge_diff
        )

    def to_json(self) -> dict[str, Any]:
        """The report as JSON, in field order, with the verdict after the name."""
        fields = asdict(self)
        return {
            "name": fields.pop("name"),
            "equal": self.equal,
            **fields,
            "elapsed_s": round(self.elapsed_s, 2),
        }


def _edge_multiset(
    graph: nx.MultiDiGraph[Any], canon: Mapping[Any, Canon], name: Any
) -> Counter[tuple[Canon, Canon, str]]:
    return Counter((canon[u], canon[v], name(k)) for u, v, k in graph.edges(keys=True))


def compare_graphs(
    tlc_graph: nx.MultiDiGraph[str],
    python_graph: nx.MultiDiGraph[int],
    *,
    name: str = "",
    limit: int = 5,
) -> ConformanceReport:
    """Compare TLC's graph (from `parse_dot`) with the checker's (`keep_graph=True`)."""
    start = time.perf_counter()
    tlc_canon = {n: canonical_tlc(d["state"]) for n, d in tlc_graph.nodes(data=True)}
    py_canon = {n: canonical_python(d["state"]) for n, d in python_graph.nodes(data=True)}
    stutter = [
        (u, v, k) for u, v, k in tlc_graph.edges(keys=True) if k in _STUTTER_ACTIONS and u == v
    ]
    tlc_core: nx.MultiDiGraph[str] = nx.MultiDiGraph(tlc_graph)
    tlc_core.remove_edges_from(stutter)
    report = ConformanceReport(
        name=name,
        tlc_states=tlc_graph.number_of_nodes(),
        python_states=python_graph.number_of_nodes(),
        tlc_edges=tlc_core.number_of_edges(),
        python_edges=python_graph.number_of_edges(),
        dropped_stutter_edges=len(stutter),
    )
    tlc_set, py_set = set(tlc_canon.values()), set(py_canon.values())
    if len(tlc_set) != len(tlc_canon):
        report.edge_diff.append("two TLC states map to one canonical state")
    if len(py_set) != len(py_canon):
        report.edge_diff.append("two Python states map to one canonical state")
    report.only_in_tlc = [describe_canon(c) for c in list(tlc_set - py_set)[:limit]]
    report.only_in_python = [describe_canon(c) for c in list(py_set - tlc_set)[:limit]]
    te = _edge_multiset(tlc_core, tlc_canon, str)
    pe = _edge_multiset(python_graph, py_canon, lambda k: str(k).split("(", 1)[0])
    for label, diff in (("only in TLC", te - pe), ("only in Python", pe - te)):
        for (u, v, act), count in list(diff.items())[:limit]:
            ux, vx = describe_canon(u), describe_canon(v)
            changed = {k: (ux[k], vx[k]) for k in VARIABLES if ux[k] != vx[k]}
            report.edge_diff.append(f"{label}: {act} x{count} changing {changed}")
    report.elapsed_s = time.perf_counter() - start
    return report


def check_conformance(
    cfg: ModelConfig, dot_path: str | Path, *, name: str = ""
) -> ConformanceReport:
    """Explore `cfg` with the Python checker and compare with TLC's dumped graph."""
    start = time.perf_counter()
    py = check(cfg, keep_graph=True)
    assert py.graph is not None
    report = compare_graphs(parse_dot(dot_path), py.graph, name=name)
    report.elapsed_s = time.perf_counter() - start
    return report


def python_edge_names(labels: Iterable[str]) -> list[str]:
    """Python action labels as TLC names them: `Observe(0,3)` -> `Observe`."""
    return [label.split("(", 1)[0] for label in labels]


def record_random_trace(
    cfg: ModelConfig,
    seed: int,
    *,
    prefetch: float = 0.5,
    machine: type[TracingRankMachine] = TracingRankMachine,
) -> ProtocolTrace:
    """Run W TracingRankMachines on `cfg`'s shards (with dynamic sharding: on what
    each round's deal gives each rank) under a random schedule (arrival order, rank
    order, prefetch while a collective is in flight) and return the recorded trace,
    as a real run would record it. `machine`: the recording class (a test's
    broken variant of the core, say)."""
    rng = random.Random(seed)
    p = cfg.protocol
    machines = [machine(r, p) for r in range(p.world_size)]
    sources = [list(shard) for shard in cfg.shards]
    if not p.deterministic:
        for src in sources:
            rng.shuffle(src)

    def dealt(r: int) -> Sample | None:
        """Dynamic sharding: the source yields what the deals gave the rank (in plan
        order when deterministic, in any order otherwise)."""
        queue = list(machines[r].queue)
        if not queue:
            return None
        return cfg.sample(queue[0] if p.deterministic else rng.choice(queue))

    def puller(r: int) -> Callable[[], Sample | None]:
        if p.dynamic:
            return lambda: dealt(r)
        return lambda: sources[r].pop(0) if sources[r] else None

    while any(m.phase.value != "done" for m in machines):
        order = list(range(p.world_size))
        rng.shuffle(order)
        for r in order:
            machines[r].fill(puller(r))
            while machines[r].needs_sample and rng.random() < prefetch:
                s = puller(r)()
                if s is None:
                    machines[r].exhaust()
                else:
                    machines[r].observe(s)
        gathered = [m.contribution for m in machines]
        assert all(c is not None for c in gathered)
        rng.shuffle(order)
        for r in order:
            machines[r].all_gather([c for c in gathered if c is not None])
    return ProtocolTrace.from_machines(machines)
