"""`odb_core.torch.trainer_checks` reads Accelerate's private state from `sys.modules`
(it never imports accelerate): every private member it reads is listed in
`versions.PRIVATE_MEMBERS["accelerate"]`, which the Accelerate adapter's version gate
checks on an upgrade, and exists in the installed release."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from odb_core.integrations import versions

CHECKS = Path(__file__).resolve().parents[1] / "odb_core" / "torch" / "trainer_checks.py"


def private_reads(source: str) -> set[str]:
    """`Owner._member` for each `getattr(<...>.Owner or Owner, "_member", ...)` and
    `getattr(owner_var, "_member")` whose owner is named by an earlier
    `owner_var = getattr(module, "Owner", ...)`."""
    tree = ast.parse(source)
    owner_of: dict[str, str] = {}
    reads: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            if (
                isinstance(call.func, ast.Name)
                and call.func.id == "getattr"
                and isinstance(call.args[1], ast.Constant)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                owner_of[node.targets[0].id] = str(call.args[1].value)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id != "getattr" or not isinstance(node.args[1], ast.Constant):
            continue
        member = str(node.args[1].value)
        if not member.startswith("_") or member.startswith("__"):
            continue
        target = node.args[0]
        if isinstance(target, ast.Name) and target.id in owner_of:
            reads.add(f"{owner_of[target.id]}.{member}")
        elif isinstance(target, ast.Attribute):
            reads.add(f"{target.attr}.{member}")
    return reads


def test_every_private_accelerate_member_trainer_checks_reads_is_gated() -> None:
    reads = private_reads(CHECKS.read_text())
    assert reads == {"GradientState._shared_state", "AcceleratorState._shared_state"}
    assert reads <= set(versions.PRIVATE_MEMBERS["accelerate"])


def test_a_new_private_read_is_caught() -> None:
    source = CHECKS.read_text() + (
        '\n\ndef _f(state):\n    return getattr(state.AcceleratorState, "_partial", None)\n'
    )
    assert "AcceleratorState._partial" in private_reads(source) - set(
        versions.PRIVATE_MEMBERS["accelerate"]
    )


def test_the_listed_members_exist_in_the_installed_accelerate() -> None:
    state = pytest.importorskip("accelerate.state")
    for owner in ("GradientState", "AcceleratorState"):
        assert versions.has_member(getattr(state, owner), "_shared_state"), owner
