"""The layout is the architecture: the runtime core (the top-level modules of
`odb_core`, what `ODBDataLoader` and the trainer adapters build on) imports
neither verification, the simulator, the adapters nor any framework, and no
module of the project takes part in an import cycle.

The import graph comes from grimp (the engine of import-linter), which counts
imports inside functions and under TYPE_CHECKING too: a lazy import is still a
dependency.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import grimp
import networkx as nx
import pytest

FORBIDDEN_FOR_CORE = (
    "odb_core.verify",
    "odb_core.torch",
    "odb_core.integrations",
    "odb_core.cli",
    "simulator",
    "torch",
    "transformers",
    "accelerate",
    "lightning",
    "numpy",
)


def _graph(*packages: str) -> grimp.ImportGraph:
    return grimp.build_graph(*packages, include_external_packages=True, cache_dir=None)


def core_modules(graph: grimp.ImportGraph, package: str) -> list[str]:
    """Top-level modules of `package` that are not subpackages (its `__init__`
    only re-exports, lazily for the adapters, so it is not part of the core)."""
    return sorted(
        m
        for m in graph.modules
        if m.count(".") == 1 and m.startswith(package + ".") and not graph.find_children(m)
    )


def core_violations(
    graph: grimp.ImportGraph, package: str, forbidden: tuple[str, ...]
) -> list[str]:
    out = []
    for m in core_modules(graph, package):
        for target in forbidden:
            if target not in graph.modules:
                continue
            chain = graph.find_shortest_chain(importer=m, imported=target, as_packages=True)
            if chain:
                out.append(f"{m} imports {target}: {' -> '.join(chain)}")
    return out


def import_cycles(graph: grimp.ImportGraph, packages: tuple[str, ...]) -> list[list[str]]:
    g: nx.DiGraph[str] = nx.DiGraph()
    internal = {m for m in graph.modules if m.split(".")[0] in packages}
    for m in internal:
        g.add_node(m)
        for imported in graph.find_modules_directly_imported_by(m):
            if imported in internal:
                g.add_edge(m, imported)
    return [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]


def test_the_runtime_core_is_what_we_think() -> None:
    core = core_modules(_graph("odb_core"), "odb_core")
    for expected in ("odb_core.protocol", "odb_core.formers", "odb_core.resume", "odb_core.window"):
        assert expected in core
    assert not any(m.startswith("odb_core.verify") for m in core)


def test_the_runtime_core_imports_no_verification_simulator_or_framework() -> None:
    assert core_violations(_graph("odb_core", "simulator"), "odb_core", FORBIDDEN_FOR_CORE) == []


def test_no_import_cycles() -> None:
    assert import_cycles(_graph("odb_core", "simulator"), ("odb_core", "simulator")) == []


@pytest.fixture
def broken_package(tmp_path: Path) -> Iterator[str]:
    """A package with both defects: its core imports its verification, and two
    of its modules import each other (one lazily)."""
    pkg = tmp_path / "layered_bug"
    (pkg / "verify").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "verify" / "__init__.py").write_text("")
    (pkg / "verify" / "checker.py").write_text("X = 1\n")
    (pkg / "protocol.py").write_text("from layered_bug.verify.checker import X\n")
    (pkg / "a.py").write_text("import layered_bug.b\n")
    (pkg / "b.py").write_text("def f():\n    import layered_bug.a\n")
    sys.path.insert(0, str(tmp_path))
    yield "layered_bug"
    sys.path.remove(str(tmp_path))


def test_the_checks_catch_a_core_import_and_a_cycle(broken_package: str) -> None:
    graph = _graph(broken_package)
    violations = core_violations(graph, broken_package, (f"{broken_package}.verify",))
    assert violations == [
        "layered_bug.protocol imports layered_bug.verify: "
        "layered_bug.protocol -> layered_bug.verify.checker"
    ]
    assert import_cycles(graph, (broken_package,)) == [["layered_bug.a", "layered_bug.b"]]
