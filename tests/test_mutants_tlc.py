"""Four mutants of the core that TLC's graph equality must kill.

Each mutant changes one line of odb_core/protocol.py (`behaviours.MUTANTS`):
`max` for `min` over open offers in decide_round; a pad instead of the last real
batch of a closing round; `final` without `len(ready) <= M`; `final` without an
empty window. With the mutant patched in, the Python model's state graph
differs from the one TLC dumped for at least one manifest model, so the
conformance check fails on it.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest
from behaviours import MUTANTS, mutant, mutated
from test_tlc import BY_NAME, manifest_results, require_tlc

from odb_core import protocol
from odb_core.verify.checker import check
from odb_core.verify.conformance import canonical_python, compare_graphs, parse_dot
from odb_core.verify.invariants import INVARIANTS
from odb_core.verify.model import GlobalModel

# Smallest first: each mutant is usually caught by the first model that reaches its line.
CONFORMANCE = sorted(
    (m for m in BY_NAME.values() if m.conformance),
    key=lambda m: m.expect.get("distinct_states") or 0,
)


def _canonical(name: str) -> tuple[frozenset[object], list[object]]:
    cfg = BY_NAME[name].model_config()
    graph = check(cfg, keep_graph=True).graph
    assert graph is not None
    canon = {n: canonical_python(d["state"]) for n, d in graph.nodes(data=True)}
    edges = sorted(
        (hash(canon[u]), hash(canon[v]), str(k).split("(", 1)[0])
        for u, v, k in graph.edges(keys=True)
    )
    return frozenset(canon.values()), edges


def test_each_mutant_changes_exactly_its_line() -> None:
    originals = {(owner, attr): getattr(owner, attr) for owner, attr, _, _ in MUTANTS.values()}
    for name in MUTANTS:
        assert mutated(name) is not None
        with mutant(name):
            owner, attr, _, _ = MUTANTS[name]
            assert getattr(owner, attr) is not originals[(owner, attr)]
    assert all(getattr(o, a) is f for (o, a), f in originals.items())
    assert protocol.decide_round is originals[(protocol, "decide_round")]


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_changes_the_python_graph_of_a_manifest_model(name: str) -> None:
    """Fast tier: the mutant's graph differs from the unmutated one, which graph
    equality ties to TLC's."""
    for m in CONFORMANCE:
        before = _canonical(m.name)
        with mutant(name):
            after = _canonical(m.name)
        if after != before:
            return
    pytest.fail(f"mutant {name} leaves every conformance model's graph unchanged")


@pytest.mark.tlc
@pytest.mark.parametrize("name", list(MUTANTS))
def test_tlc_graph_equality_kills_the_mutant(name: str) -> None:
    require_tlc()
    results = manifest_results()
    killed_by = []
    for m in CONFORMANCE:
        dot = results[m.name].dot_path
        assert dot is not None
        tlc_graph = parse_dot(dot)
        with mutant(name):
            graph = check(m.model_config(), keep_graph=True).graph
        assert graph is not None
        if not compare_graphs(tlc_graph, graph, name=m.name).equal:
            killed_by.append(m.name)
            break
    assert killed_by, f"mutant {name} conforms to TLC on every manifest model"


# ---- the oracles the mutants meet in the Python checker ------------------------


def test_python_invariants_catch_the_mutants_too() -> None:
    """max over open offers pads mid-epoch (PadsOnlyAtEnd); a quota cut one step
    late breaks the exact cut (QuotaClosure)."""
    with mutant("max-over-open-offers"):
        report = check(BY_NAME["MCjoin_w2_n7_k3_m2"].model_config())
    assert "PadsOnlyAtEnd" in report.violated()
    late = mutated_quota_cut()
    original = protocol.decide_round
    protocol.decide_round = late  # type: ignore[assignment]
    try:
        report = check(BY_NAME["MCquota_w2_n8_k3_q5"].model_config())
    finally:
        protocol.decide_round = original
    assert "QuotaClosure" in report.violated()
    assert "late" in next(v.reason for v in report.violations if v.property == "QuotaClosure")


def mutated_quota_cut() -> object:
    src = textwrap.dedent(inspect.getsource(protocol.decide_round))
    old = "            if total >= quota:\n                k, done = t + 1, True"
    assert src.count(old) == 1
    new = "            if total >= quota and t + 1 < k:\n                k, done = t + 2, True"
    namespace: dict[str, object] = {}
    exec(compile(src.replace(old, new), "<late cut>", "exec"), protocol.__dict__, namespace)
    return namespace["decide_round"]


def test_deterministic_arrival_and_step_counts_are_checked() -> None:
    cfg = BY_NAME["MCjoin_w2_n6_k2_det"].model_config()
    init = GlobalModel(cfg).init()
    assert INVARIANTS["DeterministicArrival"](init, cfg) is None
    skipped = init._replace(pending=(init.pending[0] - {max(init.pending[0])}, init.pending[1]))
    assert INVARIANTS["DeterministicArrival"](skipped, cfg) is not None
    report = check(cfg, keep_graph=True)
    assert report.graph is not None
    done = next(d["state"] for _, d in report.graph.nodes(data=True) if d["state"].all_done)
    assert INVARIANTS["ExactLossScaling"](done, cfg) is None
    counts = list(done.step_counts[0])
    s, t, loss = counts[0]
    wrong = done._replace(step_counts=(((s, t + 1, loss), *counts[1:]), *done.step_counts[1:]))
    assert INVARIANTS["ExactLossScaling"](wrong, cfg) is not None
