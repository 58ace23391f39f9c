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
    lazy = set(odb_core.api.TORCH)
    assert lazy == set(odb_core.torch.__all__)
    assert checked == lazy
    for name in lazy:
        assert getattr(odb_core, name) is getattr(odb_core.torch, name)


#: The public API, pinned: a name added, removed or renamed is a decision, made here too.
CORE_API = (
    "AttentionAware",
    "Batch",
    "BatchStats",
    "Budget",
    "ConfigError",
    "Contribution",
    "DuplicateIdError",
    "DuplicateSampleError",
    "FormerKind",
    "LossNormalization",
    "Mode",
    "Multimodal",
    "ODBError",
    "ODBPeerError",
    "OversizePolicy",
    "OversizeSampleError",
    "PackedTokens",
    "PaddedTokens",
    "PeerFault",
    "ProtocolConfig",
    "ProtocolError",
    "RankMachine",
    "RankPhase",
    "ResumeMismatchError",
    "ResumeStateError",
    "RoundDecision",
    "Sample",
    "SampleError",
    "StepInfo",
    "best_fit_decreasing",
    "decide_round",
    "make_sample",
    "sort_window_greedy",
)
TORCH_API = (
    "STEP_META_KEY",
    "MRopeIndex",
    "ODBDataLoader",
    "ProgressLR",
    "SampleLoadError",
    "StepMeta",
    "VLMPackCollate",
    "causal_lm_loss",
    "check_packed_model",
    "merge_states",
    "pack_collate",
    "pad_collate",
    "pop_step_meta",
    "sample_profile",
    "scaled_loss",
    "read_step_meta",
    "use_packed_attention",
    "vlm_pack_collate",
    "vlm_pad_collate",
)


def test_the_public_api_is_listed_once_and_pinned() -> None:
    import odb_core
    import odb_core.torch

    assert odb_core.api.CORE == CORE_API
    assert odb_core.api.TORCH == TORCH_API
    assert odb_core.__all__ == ["__version__", *CORE_API, *TORCH_API]
    assert odb_core.torch.__all__ == list(TORCH_API)
    for name in CORE_API:
        assert getattr(odb_core, name) is not None


def test_deprecated_names_work_and_warn_but_are_exported_nowhere() -> None:
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")
    import odb_core
    import odb_core.torch

    assert odb_core.api.DEPRECATED_TORCH
    for name in odb_core.api.DEPRECATED_TORCH:
        assert name not in odb_core.__all__ and name not in odb_core.torch.__all__
        assert getattr(odb_core, name) is getattr(odb_core.torch, name)
    with pytest.warns(DeprecationWarning, match="scaled_loss"):
        odb_core.scale_loss(torch.ones(()), SimpleNamespace(loss_scale=2.0))
    meta = odb_core.StepMeta(*range(len(odb_core.StepMeta._fields)))
    with pytest.warns(DeprecationWarning, match="read_step_meta"):
        assert odb_core.step_meta(meta) is meta
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        odb_core.torch.nothing  # noqa: B018
