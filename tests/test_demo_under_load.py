"""Pinned TLC figures are a function of the model alone, not of the machine's
load: the TLC part of `odb demo` passes with every CPU kept busy by another job.

Before `-lncheck final`, TLC checked liveness on a timer, so a loaded machine
reported a different distinct-state count for `MCno_fairness_bug` (416 instead
of the pinned 501) and the demo failed. This is also the suite's one run of the
demo's TLC section (it is minutes of TLC).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from odb_core.cli import check

pytestmark = [pytest.mark.tlc, pytest.mark.slow]


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def test_the_demos_tlc_section_is_as_pinned_beside_a_cpu_hog(
    cpu_hog: None, capsys: pytest.CaptureFixture[str]
) -> None:
    ok = check.demo_section()
    out = capsys.readouterr().out
    assert "all as pinned" in out, out
    assert "DIFFERS" not in out, out
    assert "graphs_equal: true" in out and "accepted" in out, out
    assert ok, out
