"""The run's plan of updates the Lightning DataModule keeps in a checkpoint
(`PLAN_KEY`) comes from disk: it is checked, and bad input names the value. Fast:
no ranks, no fit (the resumes are in test_lightning_lr_resume)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

from odb_core.errors import ResumeStateError
from odb_core.integrations.lightning import PLAN_KEY, _checked_plan


def test_lightning_checkpoint_plan_is_checked() -> None:
    good = {"world_size": 2, "max_epochs": 2, "max_steps": -1, "updates": 5, "total": 10}
    assert _checked_plan(good) == good
    assert _checked_plan(None) is None  # saved by an older odb-core
    assert _checked_plan({**good, "total": None}) == {**good, "total": None}
    with pytest.raises(ResumeStateError, match=rf"{PLAN_KEY!r} is \[1\]; expected a mapping"):
        _checked_plan([1])
    with pytest.raises(ResumeStateError, match=r"is \{'world_size': 2\}; expected a mapping"):
        _checked_plan({"world_size": 2})
    for key, bad in (("world_size", 0), ("updates", -1), ("total", 0), ("updates", "5")):
        with pytest.raises(ResumeStateError, match=rf"has {key}={bad!r}; expected an integer"):
            _checked_plan({**good, key: bad})
    with pytest.raises(ResumeStateError, match=r"has world_size=True"):
        _checked_plan({**good, "world_size": True})
