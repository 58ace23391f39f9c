"""HF's lr_scheduler_type / warmup_steps / lr_scheduler_kwargs as a progress schedule
(odb_core.integrations.hf_lr; no transformers needed)."""

from __future__ import annotations

import pytest

from odb_core.errors import ConfigError
from odb_core.integrations.hf_lr import progress_schedule
from odb_core.schedule import Schedule, Shape


def _map(kind: str, warmup: float = 0.0, kwargs: object = None) -> Schedule | None:
    return progress_schedule(
        kind, warmup_steps=warmup, scheduler_kwargs=kwargs, learning_rate=1e-3, planned_updates=40
    )


@pytest.mark.parametrize(
    ("kind", "warmup", "kwargs", "want"),
    [
        ("linear", 0.1, None, Schedule(Shape.LINEAR, warmup=0.1)),
        ("cosine", 4, {}, Schedule(Shape.COSINE, warmup=0.1)),
        ("constant", 4, None, Schedule(Shape.CONSTANT)),
        ("constant_with_warmup", 10, None, Schedule(Shape.CONSTANT, warmup=0.25)),
        ("cosine_with_min_lr", 0, {"min_lr": 1e-4}, Schedule(Shape.COSINE, final=0.1)),
        ("cosine_with_min_lr", 0, {"min_lr_rate": 0.05}, Schedule(Shape.COSINE, final=0.05)),
    ],
)
def test_types_with_a_progress_form(
    kind: str, warmup: float, kwargs: object, want: Schedule
) -> None:
    got = _map(kind, warmup, kwargs)
    assert got is not None
    assert (got.shape, got.warmup) == (want.shape, want.warmup)
    assert got.final == pytest.approx(want.final)


@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [
        ("polynomial", None),
        ("cosine_with_restarts", None),
        ("inverse_sqrt", None),
        ("reduce_lr_on_plateau", None),
        ("cosine", {"num_cycles": 2.0}),
        ("linear", {"power": 2}),
        ("linear", '{"power": 2}'),
    ],
)
def test_other_schedules_stay_the_trainers(kind: str, kwargs: object) -> None:
    assert _map(kind, 0.0, kwargs) is None


def test_bad_warmup_and_min_lr_are_named() -> None:
    with pytest.raises(ConfigError, match="warmup_steps=40"):
        _map("linear", 40)
    with pytest.raises(ConfigError, match="warmup_steps=-1"):
        _map("linear", -1)
    with pytest.raises(ConfigError, match="min_lr=None, min_lr_rate=None"):
        _map("cosine_with_min_lr", 0, {})


def test_progress_lr_runs_the_named_schedule_on_the_sources_progress() -> None:
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from odb_core.integrations.hf_lr import ClampedLR, progress_lr
    from odb_core.progress import RunProgress

    def args(kind: str) -> SimpleNamespace:
        return SimpleNamespace(
            lr_scheduler_type=kind, warmup_steps=0, lr_scheduler_kwargs=None, learning_rate=1.0
        )

    source = SimpleNamespace(run_progress=RunProgress(epoch=0, epoch_samples=100, samples=50))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = progress_lr(args("linear"), opt, source, epochs=1, planned_updates=10, tokens=None)
    assert sched.epochs == 1 and sched.get_last_lr() == [pytest.approx(0.5)]  # half the run
    assert (
        progress_lr(args("polynomial"), opt, source, epochs=1, planned_updates=10, tokens=None)
        is None
    )
    with pytest.raises(ConfigError, match="lr_tokens needs a progress-driven schedule"):
        progress_lr(args("polynomial"), opt, source, epochs=1, planned_updates=10, tokens=1)
    step = torch.optim.lr_scheduler.StepLR(opt, 1)
    clamped = ClampedLR.around(step, 3)
    assert isinstance(clamped, ClampedLR) and ClampedLR.around(clamped, 3) is clamped
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    assert ClampedLR.around(plateau, 3) is plateau
