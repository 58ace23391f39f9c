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

pytestmark = [pytest.mark.torch]


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


# ---- the facts the adapters share: prefetched passes, the updates plan, the options,
# ---- the checkpoint folder


def test_prefetched_passes_save_the_state_of_the_batch_in_training() -> None:
    """One batch ahead: the state saved is the one taken right after the batch in
    training, not after the prefetched one; a deeper prefetch or a foreign step
    is refused."""
    from odb_core.errors import ODBError
    from odb_core.torch.meta import read_step_meta
    from odb_core.torch.prefetch import PrefetchedPasses

    dl = loader(Text(40), step_meta=True)
    passes = PrefetchedPasses(dl, depth=1)
    assert passes.state() == dl.state_dict()  # nothing yielded yet
    snaps, steps, prev = [], [], None
    for batch in passes:
        step = read_step_meta(batch).step
        if prev is not None:  # Lightning: the previous batch trains while this one waits
            passes.start(prev)
            assert passes.state() == snaps[-1]  # taken right after step prev
            assert passes.progress() == dl.progress_after(prev)
            with pytest.raises(ODBError, match="not among the batches"):
                passes.start(step + 1)
        snaps.append(dl.state_dict())
        steps.append(step)
        prev = step
    assert passes.ended and len(steps) > 3
    passes.start(steps[-1])
    assert passes.state() == snaps[-1]
    assert passes.progress() == dl.run_progress
    with pytest.raises(ODBError, match="not among the batches"):
        passes.start(steps[-3])


def test_updates_plan_is_the_loaders_estimates_in_windows() -> None:
    from odb_core.torch.plan import updates_plan

    dl = loader(Text(60), grad_accum_steps=3)
    plan = updates_plan(dl, 4)
    assert plan is not None
    upper, planned = dl.steps_estimate().upper, dl.planned_steps().steps
    assert plan.upper == 4 * -(-upper // 3) and plan.planned == 4 * -(-planned // 3)
    assert plan.epoch_cap == -(-dl.step_bound() // 3) + 1 > plan.upper // 4


def test_adapter_options_are_checked_once_naming_the_value() -> None:
    from odb_core.torch.adapter_options import check_dataset, check_options

    warned: set[str] = set()
    owned = {"grad_accum_steps": "set accumulate_grad_batches"}
    assert check_options("X", {"token_budget": 8, "shuffle": True}, owned, warned) == {
        "token_budget": 8,
        "shuffle": True,
    }
    for bad, match in [
        ({"token_budget": 8, "tokenbudget": 3}, r"unknown .*\['tokenbudget'\]"),
        ({"shuffle": True}, "needs token_budget"),
        ({"token_budget": 8, "grad_accum_steps": 2}, "grad_accum_steps=2: set accumulate"),
        ({"token_budget": 8, "drop_last": True}, "drop_last=True: ODB emits"),
        ({"token_budget": 8, "step_meta": False}, "step_meta=False"),
        ({"token_budget": 8, "with_step_info": True}, "with_step_info=True"),
    ]:
        with pytest.raises(ConfigError, match=match):
            check_options("X", bad, owned, warned)
    with pytest.warns(UserWarning, match=r"X\(batch_size=4\) is ignored"):
        kept = check_options("X", {"token_budget": 8, "batch_size": 4}, owned, warned)
    assert kept == {"token_budget": 8}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_options("X", {"token_budget": 8, "batch_size": 4}, owned, warned)  # said once
    with pytest.raises(ConfigError, match="train_dataset is a DataLoader: X builds"):
        check_dataset("X", "train_dataset", torch.utils.data.DataLoader(Text(4)), "fix")
    check_dataset("X", "train_dataset", Text(4), "fix")


def test_a_checkpoint_folder_holds_the_entry_or_the_older_per_rank_files(tmp_path: Any) -> None:
    import json

    from odb_core.torch.checkpoint import read_states, write_states

    dl = loader(Text(30))
    next(iter(dl))
    entry = gather_states(dl)
    assert read_states(tmp_path) is None
    write_states(tmp_path / "ckpt", entry)
    assert read_states(tmp_path / "ckpt") == json.loads(json.dumps(entry))
    old = tmp_path / "old"
    old.mkdir()
    (old / "odb_loader_rank0.json").write_text(json.dumps(entry["ranks"][0]))
    back = read_states(old)
    assert back is not None and back["format"] == STATES_FORMAT
    assert back["ranks"] == json.loads(json.dumps(entry["ranks"]))
    (old / "odb_loader_rank2.json").write_text("{}")
    with pytest.raises(ResumeStateError, match=r"ranks \[0, 2\]"):
        read_states(old)
