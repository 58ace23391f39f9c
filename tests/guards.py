"""Hang guards: the only wall-clock limits a test may have.

A test must not fail because the machine is busy (the suite runs beside other
work, load 4-12 on 2 cores), so its limits bound work, not time. A wall-clock
limit is a hang guard only: far above the slowest run seen under load, so that
reaching it means something hung, never that the machine was slow.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

#: A subprocess, a set of ranks or a thread the test waits for: torchrun examples
#: take 1-2 min on a quiet 2-core box and 3-6 min beside a benchmark.
HANG_GUARD_S = 900

#: One TLC model run: the models are finite, so the work is bounded by the model;
#: the slowest (MCInductive_cross_*) take 8-10 min under load.
TLC_HANG_GUARD_S = 1800


def run_script(
    cmd: list[str], cwd: Path, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """An example or the CLI as a process (torchrun included): output captured as
    text, OMP_NUM_THREADS=1, and the hang guard as its only time limit."""
    full = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, env=full, cwd=cwd, check=False
    )
