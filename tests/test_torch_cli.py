"""The README's torchrun example and `odb bench` run for real (2 gloo ranks on CPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from guards import HANG_GUARD_S

from odb_core.bench.launch import free_port

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
ODB = [sys.executable, "-c", "import sys; from odb_core.cli import main; sys.exit(main())"]


def test_torchrun_example_trains_on_two_ranks() -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    cmd = [
        torchrun,
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "examples/train_ddp.py",
        "--samples",
        "300",
        "--epochs",
        "2",
        "--workers",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "epoch 1:" in out.stdout and "300 samples (dataset 300)" in out.stdout
    assert "done on 2 ranks" in out.stdout


def test_odb_bench_json_reports_one_object() -> None:
    cmd = [*ODB, "bench", "--json", "--samples", "400"]
    cmd += ["--repeats", "1", "--workers", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["ok"] is True
    assert result["odb"]["collectives_per_round"] <= 1.0
    assert result["plain"]["samples_per_s"] > 0 and result["odb"]["samples_per_s"] > 0
    assert result["params"]["ranks"] == 2


def test_odb_bench_rejects_bad_arguments() -> None:
    cmd = [*ODB, "bench", "--ranks", "0"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 2 and "'0' must be >= 1" in out.stderr
