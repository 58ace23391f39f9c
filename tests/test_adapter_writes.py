"""No trainer adapter writes loader state: the adapters read facts the loader states
(`state_after`, `epoch_closed`, `run_progress`, ...) and never assign to the
loader's attributes, to an attribute of another object that is private to it, or
into a state dict. Read from the syntax of every module of `odb_core.integrations`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ADAPTERS = Path(__file__).resolve().parents[1] / "odb_core" / "integrations"


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def _flatten(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for e in target.elts for t in _flatten(e)]
    if isinstance(target, ast.Starred):
        return _flatten(target.value)
    return [target]


def _is_self(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id in ("self", "cls")


def loader_writes(source: str, name: str = "<adapter>") -> list[str]:
    """Each write in `source` to loader state: an attribute of an expression that
    names a loader, an underscore attribute of anything but `self`, an item of
    an expression that names a state, and `setattr` on anything but `self`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        for target in (t for raw in _targets(node) for t in _flatten(raw)):
            if isinstance(target, ast.Attribute):
                owner = ast.unparse(target.value)
                if "loader" in owner.lower() or (
                    target.attr.startswith("_") and not _is_self(target.value)
                ):
                    found.append(f"{where}: {ast.unparse(target)}")
            elif isinstance(target, ast.Subscript) and "state" in ast.unparse(target.value):
                found.append(f"{where}: {ast.unparse(target)}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))
            and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr)
            in ("setattr", "__setattr__")
            and node.args
            and not _is_self(node.args[0])
        ):
            found.append(f"{where}: {ast.unparse(node)}")
    return found


def test_no_adapter_writes_loader_state() -> None:
    modules = sorted(ADAPTERS.glob("*.py"))
    assert {p.stem for p in modules} >= {"hf", "lightning", "accelerate"}
    writes = [w for p in modules for w in loader_writes(p.read_text(), p.name)]
    assert writes == [], "adapters must read the loader's facts, not write its state"


@pytest.mark.parametrize(
    "line",
    [
        "self.loader._closed = True",
        "dm._loader.epoch = 2",
        "self._loader._history, x = [], 1",
        "loader.step_info = None",
        "state['step'] = 0",
        "entry_state['ranks'][0] = {}",
        "setattr(loader, '_resume', None)",
        "object.__setattr__(dm.loader, 'epoch', 1)",
        "del self.loader._pending",
        "progress._done += 1",
    ],
)
def test_the_check_catches_a_write(line: str) -> None:
    assert loader_writes(f"def f(self, loader, dm, state, entry_state, progress, x):\n    {line}\n")


@pytest.mark.parametrize(
    "line",
    [
        "self._loader = build()",
        "self.odb_loader = None",
        "self.state.epoch = 1.0",
        "control.should_save = True",
        "setattr(self, 'x', 1)",
        "self.args.ignore_data_skip = True",
    ],
)
def test_the_check_lets_an_adapter_write_its_own_state(line: str) -> None:
    assert loader_writes(f"def f(self, control):\n    {line}\n") == []
