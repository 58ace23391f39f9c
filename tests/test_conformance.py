"""The state graph TLC explores from spec/DGAP.tla equals the Python model's.

For every manifest model marked `conformance` (W = 2 and 3, both modes, windows
1-3, packed and padded costs, deterministic mode, optimizer windows by steps and
by loss tokens, loss tokens apart from cost): the same states, and the same
multiset of (source, target, action name) edges.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import networkx as nx
import pytest
from test_tlc import BY_NAME, MANIFEST, manifest_results, require_tlc

from odb_core.verify.checker import check
from odb_core.verify.conformance import (
    canonical_python,
    canonical_tlc,
    check_conformance,
    compare_graphs,
    parse_dot,
)
from odb_core.verify.model import GlobalModel, round_robin_shards

CONFORMANCE = [m.name for m in MANIFEST if m.conformance]


def test_at_least_three_configurations_are_compared() -> None:
    assert len(CONFORMANCE) >= 3
    modes = {BY_NAME[n].mode for n in CONFORMANCE}
    worlds = {BY_NAME[n].world_size for n in CONFORMANCE}
    assert modes == {"join", "quota"} and worlds == {2, 3}
    windowed = [BY_NAME[n] for n in CONFORMANCE if BY_NAME[n].loss is not None]
    assert any(m.grad_accum_steps for m in windowed) and any(m.tokens_per_update for m in windowed)


def test_dot_dump_parser(tmp_path: Path) -> None:
    dot = tmp_path / "g.dot"
    dot.write_text(
        "strict digraph DiskGraph {\n"
        '1 [label="/\\\\ x = (0 :> {} @@ 1 :> {2})\\n/\\\\ s = \\"a\\"",style = filled]\n'
        '1 -> -2 [label="D!Observe",color="black",fontcolor="black"];\n'
        '-2 [label="/\\\\ x = (0 :> {1} @@ 1 :> {2})\\n/\\\\ s = \\"b\\""];\n'
        '1 -> -2 [label="Form",color="black",fontcolor="black"];\n'
        "}\n"
    )
    g = parse_dot(dot)
    assert g.number_of_nodes() == 2 and g.nodes["1"]["init"]
    assert sorted(k for _, _, k in g.edges(keys=True)) == ["Form", "Observe"]
    assert g.nodes["-2"]["state"]["s"] == "b"
    assert g.nodes["-2"]["state"]["x"][0] == frozenset({1})


@pytest.mark.tlc
@pytest.mark.parametrize("name", CONFORMANCE)
def test_tlc_graph_equals_python_graph(name: str) -> None:
    require_tlc()
    r = manifest_results()[name]
    assert r.dot_path is not None, r.message
    report = check_conformance(BY_NAME[name].model_config(), r.dot_path, name=name)
    assert report.equal, report.to_json()
    assert report.tlc_states == report.python_states == r.distinct_states
    assert report.tlc_edges == report.python_edges > report.tlc_states


@pytest.mark.tlc
def test_initial_states_map_to_the_same_canonical_state() -> None:
    require_tlc()
    name = CONFORMANCE[0]
    tlc_graph = parse_dot(manifest_results()[name].dot_path)  # type: ignore[arg-type]
    (init,) = [n for n, d in tlc_graph.nodes(data=True) if d["init"]]
    model = GlobalModel(BY_NAME[name].model_config())
    assert canonical_tlc(tlc_graph.nodes[init]["state"]) == canonical_python(model.init())


@pytest.mark.tlc
def test_the_comparison_finds_differences() -> None:
    require_tlc()
    name = "MCjoin_w2_n4_k1"
    m = BY_NAME[name]
    tlc_graph = parse_dot(manifest_results()[name].dot_path)  # type: ignore[arg-type]
    py = check(m.model_config(), keep_graph=True).graph
    assert py is not None
    assert compare_graphs(tlc_graph, py).equal

    # One transition missing from the Python graph.
    fewer: nx.MultiDiGraph[int] = nx.MultiDiGraph(py)
    u, v, k = next(iter(fewer.edges(keys=True)))
    fewer.remove_edge(u, v, key=k)
    report = compare_graphs(tlc_graph, fewer)
    assert not report.equal and any("only in TLC" in d for d in report.edge_diff)

    # Another model (one sample costs more): different states.
    cfg = m.model_config()
    costs = [s.tokens for shard in zip(*cfg.shards, strict=False) for s in shard]
    other = replace(cfg, shards=round_robin_shards([costs[0] + 1, *costs[1:]], 2))
    other_graph = check(other, keep_graph=True).graph
    assert other_graph is not None
    report = compare_graphs(tlc_graph, other_graph)
    assert not report.equal and report.only_in_tlc and report.only_in_python


@pytest.mark.tlc
def test_the_comparison_sees_loss_tokens_and_windows() -> None:
    """The same costs with other loss tokens, or another window rule, give other
    states: the vectors' loss tokens and the window variables are compared."""
    require_tlc()
    name = "MCjoin_w2_n5_k1_g2"
    m = BY_NAME[name]
    tlc_graph = parse_dot(manifest_results()[name].dot_path)  # type: ignore[arg-type]
    cfg = m.model_config()
    assert m.loss is not None
    loss = [m.loss[0] + 1, *m.loss[1:]]
    variants = [
        replace(cfg, shards=round_robin_shards(m.costs, m.world_size, loss)),
        replace(cfg, protocol=replace(cfg.protocol, grad_accum_steps=3)),
    ]
    for other in variants:
        graph = check(other, keep_graph=True).graph
        assert graph is not None
        report = compare_graphs(tlc_graph, graph)
        assert not report.equal and report.only_in_tlc and report.only_in_python
