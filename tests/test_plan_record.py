"""The run's plan a checkpoint keeps (`odb_core.torch.plan.RunPlan`, the HF adapter's
`odb_trainer.json` and Lightning's `PLAN_KEY` entry) comes from disk: it is checked,
and bad input names the value. Its one resume rule (`resumed_figures`): a fresh run
takes the plan's figures, the same run (world size, epochs, max_steps) the
checkpoint's, another run the updates done + the updates left. Fast: no ranks, no
fit (the resumes are in test_lightning_lr_resume and test_integration_hf)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from odb_core.errors import ResumeStateError
from odb_core.estimate import StepsEstimate
from odb_core.torch.plan import RunFigures, RunPlan, UpdatesPlan, resumed_figures

KEY = "lightning_plan"
GOOD = {
    "world_size": 2,
    "epochs": 2,
    "max_steps": -1,
    "updates": 5,
    "total": 10,
    "planned": 9,
    "warmup_base": 9,
}


def test_checkpoint_plan_is_checked() -> None:
    assert RunPlan.from_dict(GOOD, KEY) == RunPlan(**GOOD)
    assert RunPlan(**GOOD).to_dict() == GOOD
    assert RunPlan.from_dict(None, KEY) is None  # saved by an older odb-core
    plan = RunPlan.from_dict({**GOOD, "total": None, "planned": None}, KEY)
    assert plan is not None and plan.total is None and plan.planned is None
    with pytest.raises(ResumeStateError, match=rf"{KEY!r} is \[1\]; expected a mapping"):
        RunPlan.from_dict([1], KEY)
    with pytest.raises(ResumeStateError, match=r"is \{'world_size': 2\}; expected a mapping"):
        RunPlan.from_dict({"world_size": 2}, KEY)
    for key, bad in (("world_size", 0), ("updates", -1), ("total", 0), ("updates", "5")):
        with pytest.raises(ResumeStateError, match=rf"has {key}={bad!r}; expected an integer"):
            RunPlan.from_dict({**GOOD, key: bad}, KEY)
    with pytest.raises(ResumeStateError, match=r"has world_size=True"):
        RunPlan.from_dict({**GOOD, "world_size": True}, KEY)
    with pytest.raises(ResumeStateError, match=r"'odb_trainer.json' has planned=0"):
        RunPlan.from_dict({**GOOD, "planned": 0}, "odb_trainer.json")


def test_the_plans_saved_before_one_record_are_read() -> None:
    """Lightning's earlier entry (`max_epochs`) is the same plan; the HF adapter's
    earlier file held no updates done, so a resume plans afresh from it."""
    old = {"world_size": 2, "max_epochs": 2, "max_steps": -1, "updates": 5, "total": 10}
    assert RunPlan.from_dict(old, KEY) == RunPlan(2, 2, -1, 5, 10)
    hf = {
        "schedule_steps": 12,
        "planned_updates": 10,
        "num_train_epochs": 2,
        "world_size": 2,
        "gradient_accumulation_steps": 2,
    }
    assert RunPlan.from_dict(hf, "odb_trainer.json") is None


PLAN = UpdatesPlan(2, StepsEstimate(8, 10, "test"), upper=12, planned=9, epoch_cap=41)


def figures(saved: RunPlan | None, world: int, epochs: int = 2) -> RunFigures:
    asked: list[bool] = []

    def left() -> int:
        asked.append(True)
        return 20

    got = resumed_figures(PLAN, saved, world_size=world, epochs=epochs, max_steps=-1, left=left)
    assert bool(asked) == (got.replanned is not None)  # the loader asked only to replan
    return got


def test_one_resume_rule() -> None:
    assert figures(None, 2) == RunFigures(12, 9, 9)  # a fresh run: the plan's
    saved = RunPlan(2, 2, -1, updates=5, total=11, planned=10, warmup_base=10)
    assert figures(saved, 2) == RunFigures(11, 10, 10)  # the same run: the checkpoint's
    # another world size, or other epochs: done + left; the warmup's base is the run's
    assert figures(saved, 1) == RunFigures(25, 25, 10, saved, 20)
    assert figures(saved, 2, epochs=3) == RunFigures(25, 25, 10, saved, 20)
    lightning = RunPlan(2, 2, -1, updates=5, total=11)  # no central figure saved
    assert figures(lightning, 2) == RunFigures(11, 9, 9)
