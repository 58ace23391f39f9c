"""The pure schedule core: shapes of progress, warmup, the token rule, the run's
progress from yielded steps, and the fixed-batch helpers."""

from __future__ import annotations

import math

import pytest

from odb_core.errors import ConfigError, ODBError
from odb_core.progress import RunProgress, WindowCounts
from odb_core.sample import Sample
from odb_core.schedule import (
    SampleProfile,
    Schedule,
    Shape,
    TokenRule,
    TokenScaling,
    fixed_batch_tokens,
    match_fixed_batch,
)
from odb_core.step import StepInfo


@pytest.mark.parametrize(
    ("shape", "final", "mid"),
    [("linear", 0.0, 0.5), ("cosine", 0.0, 0.5), ("constant", 0.0, 1.0), ("cosine", 0.1, 0.55)],
)
def test_shapes_start_at_one_and_end_at_final(shape: str, final: float, mid: float) -> None:
    s = Schedule(shape, final=final)
    assert s.multiplier(0.0) == 1.0
    assert s.multiplier(0.5) == pytest.approx(mid)
    assert s.multiplier(1.0) == pytest.approx(1.0 if shape == "constant" else final, abs=1e-15)


def test_warmup_ramps_to_the_shape_then_decays_over_the_rest() -> None:
    s = Schedule(Shape.LINEAR, warmup=0.25)
    assert [s.multiplier(p) for p in (0.0, 0.125, 0.25, 0.625, 1.0)] == pytest.approx(
        [0.0, 0.5, 1.0, 0.5, 0.0]
    )


def test_user_shape_is_a_callable_of_progress() -> None:
    s = Schedule(lambda q: (1 - q) ** 2, warmup=0.5)
    assert s.multiplier(0.25) == pytest.approx(0.5)
    assert s.multiplier(0.75) == pytest.approx(0.25)
    assert s.multiplier(1.0) == 0.0
    with pytest.raises(ConfigError, match="nan"):
        Schedule(lambda q: math.nan).multiplier(0.3)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"shape": "exp"}, "exp"),
        ({"warmup": 1.0}, "warmup=1.0"),
        ({"warmup": -0.1}, "warmup=-0.1"),
        ({"final": 2}, "final=2"),
        ({"final": math.nan}, "final=nan"),
    ],
)
def test_bad_schedule_is_named(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Schedule(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("p", [-0.1, 1.5, math.nan])
def test_progress_outside_the_unit_interval_is_refused(p: float) -> None:
    with pytest.raises(ConfigError, match="progress"):
        Schedule().multiplier(p)


def test_token_rules() -> None:
    assert TokenScaling(100, TokenRule.LINEAR).factor(400) == 4.0
    assert TokenScaling(100, "sqrt").factor(400) == 2.0
    assert TokenScaling(100).factor(0) == 0.0
    for bad in (0, -5, math.inf):
        with pytest.raises(ConfigError, match="reference"):
            TokenScaling(bad)
    with pytest.raises(ConfigError, match="rule"):
        TokenScaling(100, "cube")  # type: ignore[arg-type]


def test_fixed_batch_reference_from_the_sample_profile() -> None:
    profile = SampleProfile.of(
        [Sample(0, 10, loss_tokens=4), Sample(1, 30, loss_tokens=8), Sample(2, 20)]
    )
    assert profile.loss_per_sample == pytest.approx((4 + 8 + 20) / 3)
    assert profile.cost_per_sample == pytest.approx(20)
    ref = fixed_batch_tokens(profile, batch_size=8, world_size=2, grad_accum_steps=4)
    assert ref == pytest.approx(64 * 32 / 3)
    assert match_fixed_batch(profile, batch_size=8, world_size=2, grad_accum_steps=4) == 683
    with pytest.raises(ConfigError, match="batch_size=0"):
        match_fixed_batch(profile, batch_size=0, world_size=2)
    with pytest.raises(ConfigError, match="at least one"):
        SampleProfile.of([])


def _step(step: int, window: int, sync: bool, samples: int, loss: int) -> StepInfo:
    return StepInfo(
        step=step,
        rank=0,
        round=0,
        is_pad=False,
        batch=None,
        local_samples=samples,
        global_samples=samples,
        local_tokens=0,
        global_tokens=0,
        local_loss_tokens=loss,
        global_loss_tokens=loss,
        window=window,
        sync_gradients=sync,
        window_samples=9,
        window_loss_tokens=90,
        loss_scale=1.0,
    )


def test_progress_moves_only_when_a_window_closes() -> None:
    t = WindowCounts()
    t.reset(samples=10, updates=1)
    t.record(_step(3, 1, False, 4, 40), last_of_epoch=False)
    p = t.progress(0, 20, closed=False)
    assert (p.samples, p.updates, p.window_loss_tokens) == (10, 1, 90)
    t.record(_step(4, 1, True, 5, 50), last_of_epoch=False)
    p = t.progress(0, 20, closed=False)
    assert (p.samples, p.loss_tokens, p.updates) == (19, 90, 2)
    assert p.fraction(2) == pytest.approx(19 / 40)
    # A prefetching trainer reads the position of the step it trains.
    assert t.after(3, 0, 20).samples == 10
    assert t.after(None, 0, 20).samples == 10
    with pytest.raises(ODBError, match="step 1"):
        t.after(1, 0, 20)


def test_run_fraction() -> None:
    assert RunProgress(epoch=1, epoch_samples=50, samples=25).fraction(2) == 0.75
    assert RunProgress(epoch=0, epoch_samples=50, samples=30, closed=True).fraction(2) == 0.5
    assert RunProgress(epoch=2, epoch_samples=50).fraction(2) == 1.0
    with pytest.raises(ConfigError, match="epochs=0"):
        RunProgress(epoch=0, epoch_samples=50).fraction(0)
    with pytest.raises(ConfigError, match="IterableDataset"):
        RunProgress(epoch=0, epoch_samples=0).fraction(1)
