"""Test tiers, by module (README "Tests"; markers in pyproject.toml).

`make check` (under 2 minutes on 2 cores) runs the pure and in-process tests:
`pytest -m "not tlc and not procs and not slow"`. `make test` runs everything.

- `tlc`: runs the TLC model checker (marked per test where it is used).
- `procs`: starts processes that run training: gloo or torchrun ranks, the
  examples, the CLI. Set here for the modules of PROCS.
- `slow`: long checks (marked per test or module, and here for SLOW).

A new module lands in the fast tier unless listed here or marked itself: list
it in PROCS if it starts ranks or examples, in SLOW if it takes minutes.
"""

from __future__ import annotations

import pytest

PROCS = frozenset(
    {
        "test_construction_peer_loss",
        "test_cross_rank_ids",
        "test_demo_under_load",
        "test_faults",
        "test_fsdp2",
        "test_integration_accelerate",
        "test_integration_hf",
        "test_integration_lightning",
        "test_model_bench",
        "test_progress_lr",
        "test_progress_lr_accelerate",
        "test_quota_dynamic_gloo",
        "test_resume_tamper",
        "test_sft_gradients",
        "test_torch_cli",
        "test_torch_distributed",
        "test_torch_dynamic",
        "test_torch_early",
        "test_torchrun_nodes",
        "test_torchrun_restart",
    }
)
SLOW: frozenset[str] = frozenset()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in PROCS:
            item.add_marker(pytest.mark.procs)
        if module in SLOW:
            item.add_marker(pytest.mark.slow)
