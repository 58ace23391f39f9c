"""Issue 31: a rank that finished its work aborted at exit (SIGABRT, "terminate
called without an active exception") when the loader's heartbeat thread was
inside a store call as the interpreter finalized: CPython ends a daemon thread
that takes the GIL during finalization with pthread_exit, whose forced unwind
runs through pybind11's noexcept ~gil_scoped_release. The transport stops and
joins its store threads at exit (an atexit hook), before finalization.

Deterministic: the store's host stalls so that the call returns during
finalization. Without the hook (transport.stop_store_threads not registered)
this exits -6 every time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from guards import HANG_GUARD_S

from odb_core.bench.launch import free_port

SCRIPT = str(Path(__file__).with_name("store_call_at_exit.py"))


@pytest.mark.procs
def test_exit_is_clean_while_the_heartbeat_is_inside_a_store_call() -> None:
    p = subprocess.run(
        [sys.executable, SCRIPT, str(free_port())],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    with contextlib.suppress(ValueError, ProcessLookupError):
        os.kill(int(p.stdout.split()[0]), signal.SIGKILL)  # the store's host
    assert "terminate called" not in p.stderr, p.stderr[-2000:]
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
