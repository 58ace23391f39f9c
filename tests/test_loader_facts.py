"""The facts the loader states for trainer adapters (docs/ADAPTERS.md, "Facts for
trainers"): the state before a prefetched step, the epoch's close, the optimizer
steps of an estimate, the window's loss denominator, every rank's state in one
checkpoint format, and the upgrade traps that the loader turns into errors or
warnings."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import Dataset  # noqa: E402

from odb_core import ODBDataLoader, StepMeta, scaled_loss  # noqa: E402
from odb_core.errors import ConfigError, ResumeStateError  # noqa: E402
from odb_core.torch import measure as measure_mod  # noqa: E402
from odb_core.torch.checkpoint import (  # noqa: E402
    STATES_FORMAT,
    gather_states,
    load_states,
)
from odb_core.torch.meta import zero_if_unweighted  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]


class Text(Dataset[dict[str, Any]]):
    def __init__(self, n: int, shifted: bool = False) -> None:
        self.n, self.shifted = n, shifted

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = torch.arange(100 + i, 100 + i + 2 + (i * 7919) % 23)
        # shifted: as the user's own code shifts them (labels[t] = input_ids[t + 1])
        labels = torch.cat([ids[1:], torch.tensor([-100])]) if self.shifted else ids.clone()
        return {"input_ids": ids, "labels": labels}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ids = [s["input_ids"] for s in samples]
    return {"input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)}


def loader(ds: Any, **kw: Any) -> ODBDataLoader:
    kw.setdefault("token_budget", 64)
    kw.setdefault("buffer_size", 8)
    kw.setdefault("collate_fn", collate)
    return ODBDataLoader(ds, **kw)


@pytest.mark.parametrize("kw", [{}, {"grad_accum_steps": 3}, {"mode": "quota", "quota": 20}])
def test_state_after_a_step_is_the_state_taken_right_after_it(kw: dict[str, Any]) -> None:
    dl = loader(Text(40), shuffle=True, seed=3, **kw)
    it = iter(dl)
    snaps: list[dict[str, Any]] = [dl.state_dict()]  # before the first step
    steps: list[int] = []
    for _ in it:
        assert dl.step_info is not None
        steps.append(dl.step_info.step)
        snaps.append(dl.state_dict())
        # A trainer that prefetched this step asks for the state after the one before.
        before = None if len(steps) == 1 else steps[-2]
        assert dl.state_after(before) == snaps[-2]
        assert dl.state_after(steps[-1]) == snaps[-1]
    assert dl.epoch_closed


def test_resuming_from_state_after_covers_the_epoch_exactly_once() -> None:
    dl = loader(Text(40), shuffle=True, seed=1)
    it = iter(dl)
    ids: list[int] = []
    for _ in range(4):
        next(it)
        assert dl.step_info is not None
        ids.extend(dl.step_info.sample_ids)
    next(it)  # prefetched, never trained
    state = dl.state_after(dl.step_info.step - 1 if dl.step_info else None)
    again = loader(Text(40), shuffle=True, seed=1)
    again.load_state_dict(state)
    for _ in again:
        assert again.step_info is not None
        ids.extend(again.step_info.sample_ids)
    assert sorted(ids) == list(range(40))


def test_epoch_closed_only_on_the_last_batch() -> None:
    dl = loader(Text(30))
    flags = []
    for _ in dl:
        flags.append(dl.epoch_closed)
    assert flags[-1] and not any(flags[:-1])


def test_optimizer_steps_and_step_bound() -> None:
    assert loader(Text(30), grad_accum_steps=4).optimizer_steps(9) == 3
    assert loader(Text(30)).optimizer_steps(9) == 9
    assert loader(Text(30), tokens_per_update=50).optimizer_steps(9) == 9
    dl = loader(Text(30))
    assert dl.step_bound() == 31 and dl.step_bound() > dl.planned_steps().upper


def _meta(**kw: Any) -> StepMeta:
    base = dict(
        step=0, window=0, is_pad=False, sync_gradients=True, world_size=2, normalization=0,
        local_samples=2, global_samples=4, local_loss_tokens=10, global_loss_tokens=30,
        window_samples=4, window_loss_tokens=30,
    )  # fmt: skip
    return StepMeta(**{**base, **kw})


def test_loss_denominator_makes_a_summed_loss_the_scaled_mean() -> None:
    meta = _meta()
    total = torch.tensor(7.0)  # this rank's sum over its 10 loss tokens
    assert (total / meta.loss_denominator).item() == pytest.approx(
        scaled_loss(meta, total / 10).item()
    )
    assert _meta(normalization=1).loss_denominator == 2.0
    pad = _meta(is_pad=True, local_samples=0, local_loss_tokens=0)
    nan = torch.tensor(float("nan"), requires_grad=True)
    zero = zero_if_unweighted(pad, nan)
    zero.backward()
    assert zero.item() == 0.0 and nan.grad is not None


# ---- one checkpoint format --------------------------------------------------------


def test_gather_and_load_states_round_trip_and_read_the_old_formats() -> None:
    dl = loader(Text(40))
    it = iter(dl)
    next(it)
    next(it)
    entry = gather_states(dl)
    assert entry["format"] == STATES_FORMAT and entry["world_size"] == 1
    for saved in (
        entry,
        {"format": "odb-accelerate-loader", "version": 1, "world_size": 1,
         "ranks": entry["ranks"]},
        {"format": "odb-lightning-datamodule", "version": 1, "world_size": 1,
         "loader_states": entry["ranks"]},
    ):  # fmt: skip
        fresh = loader(Text(40))
        load_states(fresh, saved)
        assert fresh.state_dict() == entry["ranks"][0]


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"format": "something-else", "version": 1, "ranks": [{}]}, "'something-else'"),
        ({"format": STATES_FORMAT, "version": 9, "ranks": [{}]}, "version 9"),
        ({"format": STATES_FORMAT, "version": 1, "ranks": "x"}, "not a non-empty list"),
        ({"format": STATES_FORMAT, "version": 1, "world_size": 2, "ranks": [{}]}, "world_size"),
        ([1, 2], "mapping"),
    ],
)
def test_load_states_refuses_what_is_not_the_format(entry: Any, match: str) -> None:
    with pytest.raises(ResumeStateError, match=match):
        load_states(loader(Text(10)), entry)


def test_load_states_checks_every_state_before_applying_it() -> None:
    dl = loader(Text(40))
    it = iter(dl)
    next(it)
    entry = gather_states(dl)
    entry["ranks"][0] = {**entry["ranks"][0], "step": 99}  # the checksum no longer holds
    fresh = loader(Text(40))
    with pytest.raises(ResumeStateError):
        load_states(fresh, entry)
    assert fresh.state_dict()["step"] == 0


# ---- upgrade traps -----------------------------------------------------------------


def test_labels_shifted_by_the_user_warn_naming_label_shift_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(measure_mod, "_shift_warned", False)
    with pytest.warns(UserWarning, match="label_shift=0"):
        list(loader(Text(12, shifted=True)))
    monkeypatch.setattr(measure_mod, "_shift_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(loader(Text(12, shifted=True), label_shift=0))
        list(loader(Text(12)))  # aligned labels: no warning


def test_an_odb_loader_under_accelerate_accumulation_raises_naming_the_fix() -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    try:
        accelerator = accelerate.Accelerator(gradient_accumulation_steps=4, cpu=True)
        dl = accelerator.prepare(loader(Text(12)))  # comes back untouched
        with pytest.raises(ConfigError, match="prepare_odb_loader") as err:
            for _ in dl:
                pass
        assert "gradient_accumulation_steps=1" in str(err.value)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    list(loader(Text(12)))  # no live Accelerator: no error
