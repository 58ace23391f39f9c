"""Behaviours the checked models must reach, and mutants of the core they must kill.

Shared by tests/test_behaviour_coverage.py and tests/test_mutants_tlc.py.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import networkx as nx

from odb_core import protocol
from odb_core.config import Mode
from odb_core.formers import FORMERS
from odb_core.verify.model import GlobalState, ModelConfig

Edge = tuple[GlobalState, GlobalState, str]


def _rank(label: str) -> int:
    return int(label.split("(", 1)[1].split(",")[0].rstrip(")"))


def _receives(edges: list[Edge]) -> Iterator[tuple[GlobalState, GlobalState, int]]:
    for u, v, label in edges:
        if label.startswith("Receive("):
            yield u, v, _rank(label)


def multi_step_round(cfg: ModelConfig, states: list[GlobalState], edges: list[Edge]) -> bool:
    return any(v.ranks[r].steps - u.ranks[r].steps >= 2 for u, v, r in _receives(edges))


def offers_differ(cfg: ModelConfig, states: list[GlobalState], edges: list[Edge]) -> bool:
    return any(len({c.offered for c in g}) > 1 for s in states for g in s.inbox if g is not None)


def open_offers_differ(cfg: ModelConfig, states: list[GlobalState], edges: list[Edge]) -> bool:
    """Two ranks that are not final offer different counts (min over open offers matters)."""
    return any(
        len({c.offered for c in g if not c.final}) > 1
        for s in states
        for g in s.inbox
        if g is not None
    )


def ready_exceeds_m(cfg: ModelConfig, states: list[GlobalState], edges: list[Edge]) -> bool:
    m = cfg.protocol.max_steps_per_round
    return any(len(rs.ready) > m for s in states for rs in s.ranks)


def pad_beside_real(cfg: ModelConfig, states: list[GlobalState], edges: list[Edge]) -> bool:
    for u, v, r in _receives(edges):
        pads = v.ranks[r].pads - u.ranks[r].pads
        if pads >= 1 and v.ranks[r].steps - u.ranks[r].steps > pads:
            return True
    return False


def quota_cut_mid_round(cfg: ModelConfig, states: list[GlobalState], edges: list[Edge]) -> bool:
    if cfg.protocol.mode is not Mode.QUOTA:
        return False
    for u, v, r in _receives(edges):
        gathered = u.inbox[r]
        assert gathered is not None
        ran = v.ranks[r].steps - u.ranks[r].steps
        if 1 <= ran < min(c.offered for c in gathered):
            return True
    return False


def oversized_sample(cfg: ModelConfig, states: list[GlobalState], edges: list[Edge]) -> bool:
    budget, model = cfg.protocol.budget, cfg.protocol.cost_model
    return any(
        not budget.fits_alone(smp, model)
        for s in states
        for rs in s.ranks
        for b in rs.ready
        for smp in b.samples
    )


def _cap_binds(cap: str) -> Callable[[ModelConfig, list[GlobalState], list[Edge]], bool]:
    def binds(cfg: ModelConfig, states: list[GlobalState], edges: list[Edge]) -> bool:
        p = cfg.protocol
        if getattr(p.budget, cap) is None:
            return False
        former = FORMERS[p.former]
        uncapped = replace(p.budget, **{cap: None})
        for u, _, label in edges:
            if not label.startswith("Form("):
                continue
            buf = list(u.ranks[_rank(label)].buffer)
            flush = len(buf) < p.buffer_size
            capped = former(buf, p.budget, p.cost_model, flush).batches
            if capped != former(buf, uncapped, p.cost_model, flush).batches:
                return True
        return False

    return binds


def visual_tokens(cfg: ModelConfig, states: list[GlobalState], edges: list[Edge]) -> bool:
    return any(
        smp.visual_tokens > 0
        for s in states
        for rs in s.ranks
        for b in rs.ready
        for smp in b.samples
    )


BEHAVIOURS: dict[str, Callable[[ModelConfig, list[GlobalState], list[Edge]], bool]] = {
    "k>=2 steps in a round": multi_step_round,
    "offers differ across ranks": offers_differ,
    "open offers differ across ranks": open_offers_differ,
    "len(ready) > M": ready_exceeds_m,
    "a pad beside a real batch in a round": pad_beside_real,
    "a mid-round quota cut": quota_cut_mid_round,
    "an oversized sample": oversized_sample,
    "the MaxSamples cap binds": _cap_binds("max_samples"),
    "the MaxPatches cap binds": _cap_binds("max_patches"),
    "visual tokens": visual_tokens,
}


def graph_states(graph: nx.MultiDiGraph[int]) -> tuple[list[GlobalState], list[Edge]]:
    node = graph.nodes
    states = [d["state"] for _, d in graph.nodes(data=True)]
    edges = [(node[u]["state"], node[v]["state"], k) for u, v, k in graph.edges(keys=True)]
    return states, edges


def reached(cfg: ModelConfig, graph: nx.MultiDiGraph[int]) -> set[str]:
    states, edges = graph_states(graph)
    return {name for name, f in BEHAVIOURS.items() if f(cfg, states, edges)}


# ---- mutants of the core ------------------------------------------------------

#: name -> (object, attribute, the line as written, the mutated line)
MUTANTS: dict[str, tuple[object, str, str, str]] = {
    "max-over-open-offers": (
        protocol,
        "decide_round",
        "k, done = min(open_offers), False",
        "k, done = max(open_offers), False",
    ),
    "pad-for-last-real-batch": (
        protocol.RankMachine,
        "_emit",
        "if self.ready:",
        "if self.ready and not (decision.done and t == decision.steps - 1):",
    ),
    "final-without-cap-clause": (
        protocol.RankMachine,
        "_make_contribution",
        "final = self.exhausted and not self.buffer and len(self.ready) <= m",
        "final = self.exhausted and not self.buffer",
    ),
    "final-without-empty-window": (
        protocol.RankMachine,
        "_make_contribution",
        "final = self.exhausted and not self.buffer and len(self.ready) <= m",
        "final = self.exhausted and len(self.ready) <= m",
    ),
}


def mutated(name: str) -> Callable[..., object]:
    """The function of MUTANTS[name] with its one line changed."""
    owner, attr, old, new = MUTANTS[name]
    fn = getattr(owner, attr)
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(old) == 1, (name, old)
    namespace: dict[str, object] = {}
    exec(compile(src.replace(old, new), f"<mutant {name}>", "exec"), fn.__globals__, namespace)
    out = namespace[attr]
    assert callable(out)
    return out


@contextmanager
def mutant(name: str) -> Iterator[None]:
    owner, attr, _, _ = MUTANTS[name]
    original = getattr(owner, attr)
    setattr(owner, attr, mutated(name))
    try:
        yield
    finally:
        setattr(owner, attr, original)


__all__ = ["BEHAVIOURS", "MUTANTS", "mutant", "reached"]
