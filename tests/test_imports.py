"""What importing the package pulls in: the core never imports torch or a
trainer library; the trainer integrations import theirs only when used."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "accelerate", "lightning", "pytorch_lightning")


def _imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    return set(filter(None, out.split(",")))


@pytest.mark.parametrize(
    "statement",
    [
        "import odb_core",
        "from odb_core import ProtocolConfig, RankMachine, StepInfo",
        "import odb_core.window, odb_core.estimate",
        "import odb_core.integrations",
    ],
)
def test_core_imports_pull_in_no_framework(statement: str) -> None:
    assert _imported_after(statement) == set()


def test_the_torch_adapter_imports_torch_but_no_trainer() -> None:
    assert _imported_after("import odb_core.torch") == {"torch"}


def test_the_lazy_exports_match_the_torch_adapter() -> None:
    """`odb_core`'s lazy list, its type-checking imports and `odb_core.torch.__all__`
    name the same things (a name added to one alone is caught)."""
    import ast
    from pathlib import Path

    import odb_core
    import odb_core.torch

    tree = ast.parse(Path(odb_core.__file__).read_text())
    checked = {
        alias.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for stmt in node.body
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "odb_core.torch"
        for alias in stmt.names
    }
    lazy = set(odb_core._TORCH_EXPORTS)
    assert lazy == set(odb_core.torch.__all__)
    assert checked == lazy
    for name in lazy:
        assert getattr(odb_core, name) is getattr(odb_core.torch, name)
