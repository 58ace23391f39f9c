"""Real torchrun (c10d rendezvous, --max-restarts=1): a rank kill -9'd mid-epoch;
torchrun restarts the group, which re-forms (odb_core.torch.elastic), resumes from
the last complete checkpoint and finishes: equal steps, every id once but for the
replay since the checkpoint, which is at most the checkpoint interval."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_runs import check_run, launch

SAMPLES, EPOCHS, EVERY = 120, 2, 4


@pytest.mark.parametrize("workers", [0, 2])
def test_restart_after_kill_resumes_from_checkpoint_and_finishes(
    tmp_path: Path, workers: int
) -> None:
    flags = ["--nnodes=1", "--nproc_per_node=2", "--max-restarts=1"]
    args = ["--samples", str(SAMPLES), "--every", str(EVERY), "--epochs", str(EPOCHS)]
    args += ["--workers", str(workers), "--kill-rank", "1", "--kill-step", "9"]
    codes = launch(tmp_path, [flags], worker=args)
    assert codes == [0], (tmp_path / "torchrun0.txt").read_text()[-3000:]
    facts = check_run(tmp_path, SAMPLES, EPOCHS, EVERY)
    assert facts["worlds"] == [2, 2], "torchrun did not restart"
    # killed after step 9, last complete checkpoint after step 7: steps 8, 9 (and any
    # step rank 0 ran before the failure reached it, short of the next checkpoint)
    assert facts["resume"]["epoch"] == 0 and facts["resume"]["step"] == 8
    assert 2 <= facts["replayed_steps"] <= EVERY
    assert facts["replayed_ids"] > 0
