"""The facts and checks the trainer adapters (`odb_core.integrations`) moved below
them: whole and fractional epochs done (`RunProgress`), the loader's windows set
to a trainer's (`trainer_windows`), a plan's samples per update and log line,
the updates a run has left from the loader's position (`updates_left`), a
trainer's own checkpoint file (`write_json` / `read_json`), and one version
gate per trainer library (`versions.gate`). Fast: no trainer library, no ranks."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from odb_core.errors import ConfigError
from odb_core.integrations import versions
from odb_core.progress import RunProgress


class Rows:
    """A map-style dataset of `n` token rows of varied lengths."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        return {"input_ids": torch.arange(2 + (i * 7919) % 23)}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    return {"n": torch.tensor(len(samples))}


# ---- whole and fractional epochs -------------------------------------------------------


@pytest.mark.parametrize(
    ("epoch", "samples", "closed", "done", "run"),
    [
        (0, 0, False, 0, 0.0),
        (0, 50, False, 0, 0.5),
        (0, 100, False, 0, 0.999),  # every sample consumed, the epoch not closed yet
        (0, 100, True, 1, 1.0),
        (2, 25, False, 2, 2.25),
        (2, 100, True, 3, 3.0),
    ],
)
def test_epochs_done_counts_an_epoch_once_it_closes(
    epoch: int, samples: int, closed: bool, done: int, run: float
) -> None:
    p = RunProgress(epoch=epoch, epoch_samples=100, samples=samples, closed=closed)
    assert p.epochs_done == done
    assert p.epochs_run == pytest.approx(run)
    # A run of E epochs is over exactly when the E-th closes (not one step before).
    assert (p.epochs_done >= epoch + 1) is closed


def test_epochs_run_of_an_epoch_of_unknown_size_is_whole() -> None:
    assert RunProgress(epoch=3, epoch_samples=0, samples=7).epochs_run == 3.0
    assert RunProgress(epoch=3, epoch_samples=0, closed=True).epochs_run == 4.0


# ---- the loader's windows are the trainer's ---------------------------------------------

SETTING = "Trainer(accumulate_grad_batches)"


def test_trainer_windows_take_the_trainers_accumulation() -> None:
    from odb_core.torch.adapter_options import trainer_windows

    assert trainer_windows({"token_budget": 8}, 3, SETTING, "no")["grad_accum_steps"] == 3
    assert trainer_windows({}, 1, SETTING, "no")["grad_accum_steps"] is None
    assert trainer_windows({"grad_accum_steps": 2}, 2, SETTING, "no") == {"grad_accum_steps": 2}
    with pytest.raises(ConfigError, match=r"Trainer\(accumulate_grad_batches=2\).*=4"):
        trainer_windows({"grad_accum_steps": 4}, 2, SETTING, "no")
    with pytest.raises(ConfigError, match="tokens_per_update=64: use manual"):
        trainer_windows({"tokens_per_update": 64}, 1, SETTING, "use manual")


def test_check_world_names_the_trainers_ranks() -> None:
    from types import SimpleNamespace

    from odb_core.torch.adapter_options import check_world

    check_world(SimpleNamespace(world_size=2), 2, "the Trainer", "fix")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"built for 1 rank.* the Trainer runs 2: build it later"):
        check_world(SimpleNamespace(world_size=1), 2, "the Trainer", "build it later")  # type: ignore[arg-type]


# ---- a plan's samples per update -----------------------------------------------------------


def test_plan_states_the_samples_an_update_takes() -> None:
    pytest.importorskip("torch")
    from odb_core import ODBDataLoader
    from odb_core.torch.plan import updates_plan

    for accum in (1, 3):
        dl = ODBDataLoader(
            Rows(60), token_budget=64, buffer_size=8, collate_fn=collate, grad_accum_steps=accum
        )
        plan = updates_plan(dl, 2)
        assert plan is not None and plan.samples == 60
        steps = plan.estimate.steps
        assert plan.samples_per_update == max(1, round(60 * accum / steps))
        text = plan.describe(plan.upper)
        assert f"estimated at {steps} steps" in text and f"({plan.epoch_cap} per epoch)" in text


# ---- the updates a run has left, from the loader's position -------------------------------


def test_updates_left_counts_from_the_loaders_position() -> None:
    pytest.importorskip("torch")
    from odb_core import ODBDataLoader
    from odb_core.torch.plan import updates_left, updates_plan

    def loader() -> Any:
        return ODBDataLoader(
            Rows(60), token_budget=64, buffer_size=8, collate_fn=collate, grad_accum_steps=2
        )

    dl = loader()
    plan = updates_plan(dl, 3)
    assert plan is not None
    per_epoch = plan.upper // 3
    assert updates_left(dl, 3) == plan.upper  # a fresh run: the whole plan
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ConfigError, match=rf"epochs={bad!r} must be a positive integer"):
            updates_left(dl, bad)  # type: ignore[arg-type]
    lefts, states = [], []
    for _ in dl:
        info = dl.step_info
        if info is not None and info.sync_gradients:  # a window boundary: a checkpoint's
            lefts.append(updates_left(dl, 3))
            states.append(dl.state_dict())
    # the current epoch's part shrinks with the samples consumed, then two whole epochs
    assert all(a >= b for a, b in itertools.pairwise(lefts)) and lefts[-2] < lefts[0], lefts
    assert lefts[0] <= plan.upper and lefts[-2] > lefts[-1] == 2 * per_epoch, lefts
    assert dl.epoch_closed
    assert updates_left(dl, 1) == 0  # the run's epochs are done
    resumed = loader()
    resumed.load_state_dict(states[1])  # a loaded state, not iterated yet, is the position
    assert updates_left(resumed, 3) == lefts[1]


# ---- a trainer's own file beside the loader states ---------------------------------------


def test_write_json_is_atomic_and_read_json_misses_cleanly(tmp_path: Any) -> None:
    pytest.importorskip("torch")
    from odb_core.torch.checkpoint import read_json, write_json

    assert read_json(tmp_path, "t.json") is None
    path = write_json(tmp_path / "ckpt", "t.json", {"schedule_steps": 7})
    assert read_json(tmp_path / "ckpt", "t.json") == {"schedule_steps": 7}
    assert [p.name for p in path.parent.iterdir()] == ["t.json"]  # no temporary left


# ---- one version gate per trainer library ------------------------------------------------


def test_version_gate_raises_on_a_missing_member_and_warns_outside_the_range() -> None:
    class Trainer:
        set_initial_training_values = get_batch_samples = loss_is_scaled_for_ga = None
        get_tp_size = _get_collator_with_removed_columns = None

        def __init__(self) -> None:  # instance attributes count when the source sets them
            self.callback_handler = self.control = self.accelerator = None
            self.model_accepts_loss_kwargs: bool = False
            self.optimizer, self.lr_scheduler = None, None  # a tuple counts too
            self.label_smoother = self.is_deepspeed_enabled = None

    class Plain:  # sets none of them
        set_initial_training_values = get_batch_samples = loss_is_scaled_for_ga = None
        get_tp_size = _get_collator_with_removed_columns = None

        def __init__(self) -> None:
            self.label_smoother_off = self.control == 1

    warned: set[str] = set()
    assert versions.gate("transformers", "5.24.0", {"Trainer": Trainer}, warned)
    with pytest.raises(ConfigError, match=r"no Trainer\.callback_handler, Trainer\.control"):
        versions.gate("transformers", "5.24.0", {"Trainer": Plain}, warned)
    assert not versions.has_member(Plain, "label_smoother")  # another name, a comparison
    assert versions.has_member(Trainer, "model_accepts_loss_kwargs")  # annotated
    with pytest.warns(UserWarning, match="outside the range"):
        assert not versions.gate("transformers", "5.30.0", {"Trainer": Trainer}, warned)
    del Trainer.get_batch_samples
    with pytest.raises(ConfigError, match=r"no Trainer\.get_batch_samples"):
        versions.gate("transformers", "5.24.0", {"Trainer": Trainer}, warned)
    with pytest.raises(ConfigError, match=r"Strategy\.handles_gradient_accumulation"):
        versions.gate("lightning", "2.6.0", {"Strategy": object}, warned)
    assert set(versions.GATES) == set(versions.PRIVATE_MEMBERS)


# ---- one optimizer window at a time ---------------------------------------------------------


@pytest.mark.parametrize("windows", [{"grad_accum_steps": 3}, {"tokens_per_update": 40}])
def test_next_window_is_the_batches_up_to_the_closing_step(windows: dict[str, int]) -> None:
    pytest.importorskip("torch")
    from odb_core import ODBDataLoader
    from odb_core.errors import ODBError
    from odb_core.torch.window_batches import next_window

    dl = ODBDataLoader(Rows(40), token_budget=48, buffer_size=8, collate_fn=collate, **windows)
    it = iter(dl)
    sizes, steps = [], []
    while True:
        window, infos = next_window(it, dl)
        if not window:
            break
        assert all(i is not None for i in infos) and infos[-1].sync_gradients  # type: ignore[union-attr]
        assert not any(i.sync_gradients for i in infos[:-1])  # type: ignore[union-attr]
        sizes.append(len(window))
        steps += [i.step for i in infos]  # type: ignore[union-attr]
    assert steps == list(range(len(steps))) and dl.epoch_closed
    if "grad_accum_steps" in windows:
        assert sizes[:-1] == [3] * (len(sizes) - 1) and 1 <= sizes[-1] <= 3
    else:
        assert len(set(sizes)) > 1  # windows of loss tokens: their lengths vary
    with pytest.raises(ODBError, match="without ODB step metadata"):
        next_window(iter([{"n": 1}]), dl)
