"""The layout is the architecture: the runtime core (the top-level modules of
`odb_core`, what `ODBDataLoader` and the trainer adapters build on) imports
neither verification, the simulator, the adapters nor any framework; the runtime
adapters (`odb_core.torch`, `odb_core.integrations`) import neither
verification, the simulator, the bench harnesses nor the CLI, and importing
`odb_core.torch` loads none of them nor transformers; no module of the project
takes part in an import cycle.

The import graph comes from grimp (the engine of import-linter), which counts
imports inside functions and under TYPE_CHECKING too: a lazy import is still a
dependency.
"""

from __future__ import annotations

import ast
import json
import subprocess
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


RUNTIME_ADAPTERS = ("odb_core.torch", "odb_core.integrations")
FORBIDDEN_FOR_ADAPTERS = ("odb_core.verify", "odb_core.bench", "odb_core.cli", "simulator")
ROOT = Path(__file__).resolve().parents[1]
# Runtime-core modules split into a package by job: its modules are core modules.
CORE_PACKAGES = ("odb_core.resume",)


def _graph(*packages: str) -> grimp.ImportGraph:
    return grimp.build_graph(*packages, include_external_packages=True, cache_dir=None)


def core_modules(graph: grimp.ImportGraph, package: str) -> list[str]:
    """Top-level modules of `package` that are not subpackages (its `__init__`
    only re-exports, lazily for the adapters, so it is not part of the core), and
    every module of the core's own packages (`CORE_PACKAGES`)."""
    core = {
        m
        for m in graph.modules
        if m.count(".") == 1 and m.startswith(package + ".") and not graph.find_children(m)
    }
    for sub in CORE_PACKAGES:
        if sub.startswith(package + ".") and sub in graph.modules:
            core |= {sub} | graph.find_descendants(sub)
    return sorted(core)


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
    # the resume package's modules, each of them, not only its __init__
    assert {"odb_core.resume.codec", "odb_core.resume.claims"} <= set(core)
    assert not any(m.startswith("odb_core.verify") for m in core)


def test_the_runtime_core_imports_no_verification_simulator_or_framework() -> None:
    assert core_violations(_graph("odb_core", "simulator"), "odb_core", FORBIDDEN_FOR_CORE) == []


def test_no_import_cycles() -> None:
    assert import_cycles(_graph("odb_core", "simulator"), ("odb_core", "simulator")) == []


def adapter_violations(
    graph: grimp.ImportGraph, adapters: tuple[str, ...], forbidden: tuple[str, ...]
) -> list[str]:
    """Each module of the `adapters` packages that reaches a `forbidden` package,
    directly or through any chain of imports."""
    out = []
    for package in adapters:
        for m in sorted(graph.find_descendants(package) | {package}):
            for target in forbidden:
                if target not in graph.modules:
                    continue
                for t in sorted(graph.find_descendants(target) | {target}):
                    chain = graph.find_shortest_chain(importer=m, imported=t)
                    if chain:
                        out.append(f"{m} imports {target}: {' -> '.join(chain)}")
                        break
    return out


def imported_names(path: Path, module: str) -> set[str]:
    """Every module name `path` (the module `module`) imports, read from its syntax
    tree: top-level, lazy (inside functions) and TYPE_CHECKING imports alike;
    relative imports resolved against `module`."""
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def forbidden_imports(
    root: Path, packages: tuple[str, ...], forbidden: tuple[str, ...]
) -> list[str]:
    """`file imports name` for each import, in any module under `packages` (found
    under `root`), of a module in or under a `forbidden` package."""
    out = []
    for package in packages:
        for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            for name in sorted(imported_names(path, module)):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    out.append(f"{path.relative_to(root)} imports {name}")
    return out


def modules_loaded_by(statement: str) -> set[str]:
    """The modules in `sys.modules` after running `statement` in a fresh interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return set(json.loads(run.stdout.splitlines()[-1]))


def test_the_runtime_adapters_import_no_verification_simulator_bench_or_cli() -> None:
    graph = _graph("odb_core", "simulator")
    assert adapter_violations(graph, RUNTIME_ADAPTERS, FORBIDDEN_FOR_ADAPTERS) == []


def test_no_adapter_module_names_a_forbidden_import() -> None:
    assert forbidden_imports(ROOT, RUNTIME_ADAPTERS, FORBIDDEN_FOR_ADAPTERS) == []


@pytest.mark.parametrize(
    ("statement", "forbidden"),
    [
        ("import odb_core.torch", (*FORBIDDEN_FOR_ADAPTERS, "transformers")),
        ("from odb_core import ODBDataLoader", (*FORBIDDEN_FOR_ADAPTERS, "transformers")),
        (
            "import odb_core.integrations.hf, odb_core.integrations.accelerate, "
            "odb_core.integrations.lightning, odb_core.integrations.trl",
            FORBIDDEN_FOR_ADAPTERS,
        ),
    ],
)
def test_importing_the_runtime_loads_no_verification_simulator_or_transformers(
    statement: str, forbidden: tuple[str, ...]
) -> None:
    pytest.importorskip("torch")
    loaded = modules_loaded_by(statement)
    assert (
        sorted(m for m in loaded if m.split(".")[0] in forbidden or m.startswith(forbidden)) == []
    )


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


@pytest.fixture
def broken_adapter(tmp_path: Path) -> Iterator[Path]:
    """A package whose adapter imports its verification twice over: one module at
    top level, one lazily and relatively inside a function."""
    pkg = tmp_path / "adapter_bug"
    for sub in ("verify", "torch"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "verify" / "trace.py").write_text("X = 1\n")
    (pkg / "torch" / "loader.py").write_text("from adapter_bug.verify.trace import X\n")
    (pkg / "torch" / "pipeline.py").write_text("def f():\n    from ..verify import trace\n")
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))


def test_the_adapter_checks_catch_a_direct_and_a_lazy_relative_import(broken_adapter: Path) -> None:
    assert forbidden_imports(broken_adapter, ("adapter_bug.torch",), ("adapter_bug.verify",)) == [
        "adapter_bug/torch/loader.py imports adapter_bug.verify.trace",
        "adapter_bug/torch/loader.py imports adapter_bug.verify.trace.X",
        "adapter_bug/torch/pipeline.py imports adapter_bug.verify",
        "adapter_bug/torch/pipeline.py imports adapter_bug.verify.trace",
    ]
    graph = _graph("adapter_bug")
    assert adapter_violations(graph, ("adapter_bug.torch",), ("adapter_bug.verify",)) == [
        "adapter_bug.torch.loader imports adapter_bug.verify: "
        "adapter_bug.torch.loader -> adapter_bug.verify.trace",
        "adapter_bug.torch.pipeline imports adapter_bug.verify: "
        "adapter_bug.torch.pipeline -> adapter_bug.verify.trace",
    ]
