"""Test tiers, by module (README "Tests"; markers in pyproject.toml).

`make check` (under 2 minutes on 2 cores) runs the pure and in-process tests:
`pytest -m "not tlc and not procs and not slow"`. `make test` runs everything.

- `tlc`: runs the TLC model checker (marked per test where it is used).
- `procs`: starts processes that run training: gloo or torchrun ranks, the
  examples, the CLI. Set here for the modules of PROCS.
- `slow`: long checks (marked per test or module, and here for SLOW).

A new module lands in the fast tier unless listed here or marked itself: list
it in PROCS if it starts ranks or examples, in SLOW if it takes minutes.

`make unit` runs on two pytest-xdist workers (`-n 2 --dist loadgroup`), in
groups (`group_of`): each module is one group, so its module-scoped fixtures
(one launch of ranks shared by several tests) run once, on one worker; the
modules of TLC_SESSION are one group, since they share one run of the manifest
(tests/test_tlc.py, both cores). Every launch of ranks or torchrun picks a free
port, so two modules' ranks may run at once. Groups start heaviest first
(HEAVY_FIRST), then in file order. (The groups are made here, by
`pytest_xdist_make_scheduler`: xdist's own `xdist_group` marks do not group
under pytest 9.)
"""

from __future__ import annotations

from typing import Any

import pytest

PROCS = frozenset(
    {
        "test_construction_peer_loss",
        "test_cost_table_loader",
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
        "test_window_bytes_loader",
        "test_torchrun_nodes",
        "test_torchrun_restart",
    }
)
SLOW: frozenset[str] = frozenset()

#: The modules that read tests/test_tlc.py's one session run of the manifest.
TLC_SESSION = frozenset(
    {"test_tlc", "test_conformance", "test_mutants_tlc", "test_demo_under_load"}
)

#: The longest groups (minutes of CPU, or of waiting on timers), started first so
#: that the last group to finish is a short one.
HEAVY_FIRST = (
    "tlc-session",
    "test_faults",
    "test_torch_distributed",
    "test_integration_hf",
    "test_integration_lightning",
    "test_trace_tlc",
    "test_model_bench",
    "test_torch_dynamic",
    "test_torchrun_nodes",
    "test_fsdp2",
    "test_integration_accelerate",
    "test_tlc_proofs",
    "test_stateful",
)


def group_of(module: str) -> str:
    """The xdist group of a test module (its name without .py)."""
    return "tlc-session" if module in TLC_SESSION else module


def _module(item: pytest.Item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1] if item.module else ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = _module(item)
        if module in PROCS:
            item.add_marker(pytest.mark.procs)
        if module in SLOW:
            item.add_marker(pytest.mark.slow)
    if getattr(config.option, "loadgroup", False):  # an xdist worker of `make unit`
        rank = {g: i for i, g in enumerate(HEAVY_FIRST)}
        items.sort(key=lambda it: rank.get(group_of(_module(it)), len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`: one group per module, TLC_SESSION's modules together,
    in the workers' order (heaviest first)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py"))

    config.option.loadscopereorder = False
    return ModuleGroups(config, log)
