"""Print each benchmark's measured quantities (extra_info) after the timing table."""

from __future__ import annotations

from typing import Any

import pytest


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None:
        return
    rows = [(b.name, b.extra_info) for b in session.benchmarks if b.extra_info]
    if not rows:
        return
    terminalreporter.section("benchmark measurements (medians)")
    for name, info in rows:
        terminalreporter.write_line(f"{name:55} " + "  ".join(f"{k}={v}" for k, v in info.items()))
