"""The HF Trainer adapter (`ODBHFTrainer`) on real processes, and its bad-input errors.

Two gloo ranks on CPU run `ODBHFTrainer` (transformers' own `Trainer.train`; DDP set
up by transformers/accelerate from RANK/WORLD_SIZE on an initialised gloo group)
on a tiny float64 `LlamaForCausalLM` and masked-prompt SFT samples with
long-tailed lengths (`sft_support.py`). A callback records, at every
`on_pre_optimizer_step`, the window's sample ids and pad flags on each rank (from
`trainer.odb_window_info`) and, where asked, the gradient DDP left. The parent
process compares the gradients with one process's per-token mean over the same
samples, and checks coverage. One launch runs, in order:

- `g1`: `gradient_accumulation_steps=1`, uneven shards (rank 1 runs dry and pads):
  the first optimizer step and a step where rank 1 pads;
- `g2`: `gradient_accumulation_steps=2`, some samples fully masked, an odd step
  count (the epoch's last window is one step): the first and the last window;
- `g1_noavg`, `g2_mean`: the same without `average_tokens_across_devices`, and
  with a model that takes no loss kwargs (its mean loss x the core's scale);
- `epochs`: 2 epochs, G=2, a real learning rate, a checkpoint every 3 steps and at
  each epoch's end: every sample once per epoch, other orders in the two epochs,
  equal optimizer steps, the cosine schedule on the run's progress ending at 0 on
  the last update, `state.max_steps` the planned total, then the real one;
- `lr_g1`: 2 epochs, G=1, linear decay with warmup: ends at 0 on the last update;
- `max_steps`: `max_steps=8` stops there (inside epoch 1);
- `resume0`, `resume1`, `resume_end`, `resume_final`: `train(resume_from_checkpoint=...)`
  from a checkpoint inside epoch 0, inside epoch 1, at epoch 0's end and after the
  last epoch: each epoch covered exactly once, no third epoch, and (deterministic
  loader, same world size) the very windows of the uninterrupted run.

Learning rate 0 in `g1`/`g2`: the parameters stay at their seeded init, so every
window is compared against the same model. Each gradient check also computes
what a wrong normalisation gives on the same samples and shows it misses by
more than 1e-4, so the comparison can fail.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
from guards import HANG_GUARD_S, run_script

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gloo_ranks import launch as launch_ranks  # noqa: E402
from gloo_ranks import launch_entry, ok, set_rank_env  # noqa: E402
from sft_support import (  # noqa: E402
    MODELS,
    ChatSFT,
    Reference,
    flat_grad,
    lora_llama,
    pad_collate,
    rel_l2,
    tiny_llama,
)
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from odb_core.bench.launch import free_port, init_local_gloo, release_child_resources  # noqa: E402
from odb_core.errors import ConfigError  # noqa: E402
from odb_core.integrations import hf  # noqa: E402
from odb_core.integrations.hf import ODBArguments, ODBHFTrainer  # noqa: E402
from odb_core.torch import ProgressLR  # noqa: E402

pytestmark = [pytest.mark.torch]


def distributed(test: Any) -> Any:
    """A test that reads the 2-rank launch (one launch for all, 15-25 s on 2 cores)."""
    return pytest.mark.slow(test)


WORLD = 2
TOL = 1e-6
WRONG = 1e-4

# Each scenario: the dataset, the loader options and the Trainer arguments.
SCENARIOS: dict[str, dict[str, Any]] = {
    "g1": {
        "data": {"n": 48, "seed": 2, "skew": True},
        "odb": {"token_budget": 512, "shuffle": False},
        "args": {"gradient_accumulation_steps": 1, "learning_rate": 0.0, "num_train_epochs": 1},
        "grads": True,
    },
    "g2": {
        "data": {"n": 68, "seed": 3, "masked_every": 7},
        "odb": {"token_budget": 192, "seed": 11},
        "args": {"gradient_accumulation_steps": 2, "learning_rate": 0.0, "num_train_epochs": 1},
        "grads": True,
    },
    "epochs": {
        "data": {"n": 96, "seed": 4},
        "odb": {"token_budget": 192, "seed": 5},
        "args": {
            "gradient_accumulation_steps": 2,
            "learning_rate": 1e-3,
            "num_train_epochs": 2,
            "save_strategy": "steps",
            "save_steps": 3,
        },
        "grads": False,
    },
    "lr_g1": {
        "data": {"n": 48, "seed": 6},
        "odb": {"token_budget": 192, "seed": 7},
        "args": {
            "gradient_accumulation_steps": 1,
            "learning_rate": 1e-3,
            "num_train_epochs": 2,
            "lr_scheduler_type": "linear",
            "warmup_steps": 0.1,
        },
        "grads": False,
    },
}
# The same runs with the Trainer's other loss paths: no `average_tokens_across_devices`
# multiplier, and a model that takes no loss kwargs (its mean loss x loss_scale).
SCENARIOS["g1_noavg"] = {
    **SCENARIOS["g1"],
    "args": {**SCENARIOS["g1"]["args"], "average_tokens_across_devices": False},
}
SCENARIOS["g2_mean"] = {**SCENARIOS["g2"], "model": {"accepts_loss_kwargs": False}}
# PEFT LoRA (`sft_support.lora_llama`): the gradient on the adapter weights, and
# adapter-only checkpoints resumed (on 2 ranks here, on one process in the test).
SCENARIOS["g2_lora"] = {**SCENARIOS["g2"], "model_kind": "lora"}
SCENARIOS["epochs_lora"] = {**SCENARIOS["epochs"], "model_kind": "lora"}
COMMON_ODB = {
    "deterministic": True,
    "buffer_size": 16,
    "max_steps_per_round": 4,
}


# ---- what runs inside a rank ----------------------------------------------------------


class Recorder(TrainerCallback):
    """Per optimizer step: the window's ids and pad flags on this rank, the epoch,
    the learning rate and (optionally) the gradient."""

    def __init__(self, grads: bool) -> None:
        self.grads = grads
        self.trainer: Any = None
        self.windows: list[dict[str, Any]] = []
        self.bar_totals: list[int] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        t = self.trainer
        infos = t.odb_window_info
        self.windows.append(
            {
                "epoch": t.odb_loader.epoch,
                "steps": [i.step for i in infos],
                "ids": [[int(x) for x in i.sample_ids] for i in infos],
                "pads": [bool(i.is_pad) for i in infos],
                "lr": float(t.lr_scheduler.get_last_lr()[0]),
                "global_step": state.global_step,
                "grad": flat_grad(kw["model"]) if self.grads else None,
            }
        )

        for cb in t.callback_handler.callbacks:
            bar = getattr(cb, "training_bar", None)
            if bar is not None:
                self.bar_totals.append(bar.total)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if args.save_strategy != "no":
            control.should_save = True  # a checkpoint at each epoch's end too


def make_trainer(name: str, out: Path, **extra: Any) -> tuple[Any, Recorder]:
    sc = SCENARIOS[name]
    options: dict[str, Any] = {
        "output_dir": str(out),
        "use_cpu": True,
        "ddp_backend": "gloo",
        "report_to": [],
        "disable_tqdm": True,
        "logging_strategy": "no",
        "save_strategy": "no",
        "max_grad_norm": 0.0,
        "weight_decay": 0.0,
        "warmup_steps": 0,
        "lr_scheduler_type": "cosine",
        "seed": 0,
        "ddp_find_unused_parameters": False,
    }
    args = TrainingArguments(**{**options, **sc["args"], **extra})
    rec = Recorder(sc["grads"])
    model = MODELS[sc.get("model_kind", "full")](seed=0)
    for attr, value in sc.get("model", {}).items():
        setattr(model, attr, value)
    trainer = ODBHFTrainer(
        model=model,
        args=args,
        train_dataset=ChatSFT(**sc["data"]),
        data_collator=pad_collate,
        odb=ODBArguments(**{**COMMON_ODB, **sc["odb"]}),
        callbacks=[rec],
    )
    rec.trainer = trainer
    return trainer, rec


def run(name: str, out: Path, resume: str | None = None, **extra: Any) -> dict[str, Any]:
    trainer, rec = make_trainer(name, out, **extra)
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    sched = trainer.lr_scheduler
    return {
        "windows": rec.windows,
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "schedule": trainer._odb_schedule_steps,
        "sched_last": getattr(getattr(sched, "scheduler", None), "last_epoch", None),
        "clamped": isinstance(sched, hf.ClampedLR),
        "progress_lr": isinstance(sched, ProgressLR),
        "final_lr": float(sched.get_last_lr()[0]),
        "max_steps": trainer.state.max_steps,
        "planned": trainer._odb_planned_updates,
        "bar_totals": rec.bar_totals,
        "root": str(out),
        "time": time.perf_counter() - t0,
    }


def _checkpoint_inside(windows: list[dict[str, Any]], epoch: int, every: int) -> int:
    """The first saved step that falls strictly inside `epoch` (not at its end)."""
    last = max(w["global_step"] for w in windows if w["epoch"] == epoch) + 1
    first = min(w["global_step"] for w in windows if w["epoch"] == epoch) + 1
    return next(s for s in range(first, last) if s % every == 0)


def _rank_entry(rank: int, world: int, port: int, out: str) -> None:
    set_rank_env(rank, world, port, OMP_NUM_THREADS="1")
    init_local_gloo(rank, world, port, timeout_s=HANG_GUARD_S)
    warnings.simplefilter("ignore")
    try:
        root = Path(out)
        result: dict[str, Any] = {}
        for name in (
            "g1",
            "g1_noavg",
            "g2",
            "g2_mean",
            "g2_lora",
            "epochs",
            "epochs_lora",
            "lr_g1",
        ):
            result[name] = run(name, root / name)
            torch.save(result, root / f"rank{rank}.pt")
        every = SCENARIOS["epochs"]["args"]["save_steps"]
        for epoch in (0, 1):
            step = _checkpoint_inside(result["epochs"]["windows"], epoch, every)
            ckpt = root / "epochs" / f"checkpoint-{step}"
            r = run("epochs", root / f"resume{epoch}", resume=str(ckpt), save_strategy="no")
            r["from"] = step
            result[f"resume{epoch}"] = r
        # max_steps keeps the Trainer's meaning: stop after that many optimizer steps.
        result["max_steps"] = run("epochs", root / "max_steps", max_steps=8, save_strategy="no")
        # From the checkpoint at epoch 0's end, and from the last one (nothing left).
        windows = result["epochs"]["windows"]
        end0 = max(w["global_step"] for w in windows if w["epoch"] == 0) + 1
        for label, step in (("resume_end", end0), ("resume_final", len(windows))):
            ckpt = root / "epochs" / f"checkpoint-{step}"
            r = run("epochs", root / label, resume=str(ckpt), save_strategy="no")
            r["from"] = step
            result[label] = r
        torch.save(result, root / f"rank{rank}.pt")
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
    release_child_resources()
    os._exit(0)


def launch(out: Path, timeout: float = HANG_GUARD_S) -> list[dict[str, Any]]:
    return launch_entry(_rank_entry, WORLD, out, timeout=timeout)


# ---- the parent's view ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    out = launch(tmp_path_factory.mktemp("hf"))
    times = {k: round(v["time"], 1) for k, v in out[0].items()}
    print(f"\nhf launch {time.perf_counter() - t0:.1f}s; per run {times}")
    return out


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama(seed=0)


def window_ids(ranks: list[dict[str, Any]], name: str, w: int) -> list[int]:
    return [i for r in ranks for ids in r[name]["windows"][w]["ids"] for i in ids]


def epoch_ids(windows: list[dict[str, Any]], epoch: int) -> list[int]:
    return [i for w in windows if w["epoch"] == epoch for ids in w["ids"] for i in ids]


def all_ranks_epoch_ids(ranks: list[dict[str, Any]], name: str, epoch: int) -> list[int]:
    return [i for r in ranks for i in epoch_ids(r[name]["windows"], epoch)]


def ddp_mean_of_rank_means(ref: Any, ranks: list[dict[str, Any]], name: str, w: int) -> Any:
    """What a loss that is each rank's own per-token mean, averaged by DDP (no ODB
    scale: HF's loss without num_items_in_batch), gives over the window's steps."""
    total = None
    for r in ranks:
        for ids in r[name]["windows"][w]["ids"]:
            if ids:
                g, n = ref.summed(ids)
                if n:
                    part = g / n / WORLD
                    total = part if total is None else total + part
    return total


def per_micro_step_mean(ref: Any, ranks: list[dict[str, Any]], name: str, w: int) -> Any:
    """Each micro-step normalised by its own global tokens, then `/ G`."""
    steps = len(ranks[0][name]["windows"][w]["ids"])
    total = None
    for t in range(steps):
        ids = [i for r in ranks for i in r[name]["windows"][w]["ids"][t]]
        g, n = ref.summed(ids)
        if n:
            total = g / n / steps if total is None else total + g / n / steps
    return total


@distributed
def test_ranks_agree_on_every_optimizer_step(ranks: list[dict[str, Any]]) -> None:
    for name in ("g1", "g1_noavg", "g2", "g2_mean", "epochs", "resume0", "resume1", "resume_end"):
        a, b = ranks[0][name], ranks[1][name]
        start = a.get("from", 0)
        assert a["global_step"] == b["global_step"] == start + len(a["windows"]), name
        assert [w["global_step"] for w in a["windows"]] == list(range(start, a["global_step"]))
        for wa, wb in zip(a["windows"], b["windows"], strict=True):
            assert wa["steps"] == wb["steps"] and wa["epoch"] == wb["epoch"], name
            assert wa["global_step"] == wb["global_step"]
        if a["windows"][0]["grad"] is not None:
            worst = max(
                rel_l2(wb["grad"], wa["grad"])
                for wa, wb in zip(a["windows"], b["windows"], strict=True)
            )
            assert worst <= 1e-12, f"{name}: ranks hold different gradients ({worst})"


@distributed
def test_g1_first_step_and_pad_step_match_single_process(
    ranks: list[dict[str, Any]], model: Any
) -> None:
    run0, run1 = ranks[0]["g1"], ranks[1]["g1"]
    ref = Reference(model, ChatSFT(**SCENARIOS["g1"]["data"]))
    assert all(len(w["steps"]) == 1 for w in run0["windows"])
    err = rel_l2(run0["windows"][0]["grad"], ref.mean(window_ids(ranks, "g1", 0)))
    print(f"[g1] first step rel L2 {err:.3g}")
    assert err <= TOL
    pads = [
        w
        for w, (a, b) in enumerate(zip(run0["windows"], run1["windows"], strict=True))
        if b["pads"][0] and not a["pads"][0]
    ]
    assert pads, "rank 1 never padded: the shards are not uneven enough"
    w = pads[0]
    want = ref.mean(window_ids(ranks, "g1", w))
    err = rel_l2(run0["windows"][w]["grad"], want)
    wrong = rel_l2(ddp_mean_of_rank_means(ref, ranks, "g1", w), want)
    print(f"[g1] pad step {w} rel L2 {err:.3g}; DDP mean of rank means {wrong:.3g}")
    assert err <= TOL < WRONG < wrong
    wrong0 = rel_l2(
        ddp_mean_of_rank_means(ref, ranks, "g1", 0), ref.mean(window_ids(ranks, "g1", 0))
    )
    assert wrong0 > WRONG


@distributed
def test_g2_first_and_short_last_window_match_single_process(
    ranks: list[dict[str, Any]], model: Any
) -> None:
    run0 = ranks[0]["g2"]
    windows = run0["windows"]
    sizes = [len(w["steps"]) for w in windows]
    assert sizes[:-1] == [2] * (len(sizes) - 1) and sizes[-1] == 1, sizes
    steps = [s for w in windows for s in w["steps"]]
    assert steps == list(range(len(steps))) and len(windows) == math.ceil(len(steps) / 2)
    ref = Reference(model, ChatSFT(**SCENARIOS["g2"]["data"]))
    for w in (0, len(windows) - 1):
        want = ref.mean(window_ids(ranks, "g2", w))
        err = rel_l2(windows[w]["grad"], want)
        print(f"[g2] window {w} ({sizes[w]} steps) rel L2 {err:.3g}")
        assert err <= TOL
    want = ref.mean(window_ids(ranks, "g2", 0))
    wrong = rel_l2(per_micro_step_mean(ref, ranks, "g2", 0), want)
    print(f"[g2] window 0, per-micro-step normalisation rel L2 {wrong:.3g}")
    assert wrong > WRONG
    n = SCENARIOS["g2"]["data"]["n"]
    assert sorted(all_ranks_epoch_ids(ranks, "g2", 0)) == list(range(n))


@distributed
@pytest.mark.parametrize(("name", "base"), [("g1_noavg", "g1"), ("g2_mean", "g2")])
def test_other_loss_paths_give_the_same_gradients(
    ranks: list[dict[str, Any]], model: Any, name: str, base: str
) -> None:
    """Without the Trainer's world-size multiplier, and for a model that takes no
    loss kwargs (its mean loss x the core's scale): the same windows, the same
    gradients, each equal to the single-process mean."""
    got, want = ranks[0][name]["windows"], ranks[0][base]["windows"]
    assert [w["steps"] for w in got] == [w["steps"] for w in want]
    assert [w["ids"] for w in got] == [w["ids"] for w in want]
    worst = max(rel_l2(a["grad"], b["grad"]) for a, b in zip(got, want, strict=True))
    ref = Reference(model, ChatSFT(**SCENARIOS[name]["data"]))
    err = max(rel_l2(w["grad"], ref.mean(window_ids(ranks, name, i))) for i, w in enumerate(got))
    print(f"[{name}] vs [{base}] max rel L2 {worst:.3g}; vs single process {err:.3g}")
    assert worst <= TOL and err <= TOL


@distributed
def test_two_epochs_every_sample_once_in_other_orders(ranks: list[dict[str, Any]]) -> None:
    n = SCENARIOS["epochs"]["data"]["n"]
    run0 = ranks[0]["epochs"]
    assert {w["epoch"] for w in run0["windows"]} == {0, 1}
    orders = []
    for epoch in (0, 1):
        ids = all_ranks_epoch_ids(ranks, "epochs", epoch)
        assert sorted(ids) == list(range(n)), f"epoch {epoch}: not every sample exactly once"
        orders.append(ids)
        windows = [w for w in run0["windows"] if w["epoch"] == epoch]
        steps = [s for w in windows for s in w["steps"]]
        assert steps == list(range(len(steps)))
        assert len(windows) == math.ceil(len(steps) / 2), "the last short window was not stepped"
    assert orders[0] != orders[1]
    assert run0["epoch"] == pytest.approx(2.0)
    # The estimate (not the Trainer's step cap, 2 x 49) sizes the planned total.
    assert run0["global_step"] // 2 < run0["schedule"] < 49
    assert run0["global_step"] // 2 < run0["planned"] < 49
    # A run that dropped the tail of an epoch, or a second pass, is caught.
    assert sorted(all_ranks_epoch_ids(ranks, "epochs", 0)[:-1]) != list(range(n))


@distributed
@pytest.mark.parametrize("epoch", [0, 1])
def test_resume_mid_epoch_trains_each_sample_once(ranks: list[dict[str, Any]], epoch: int) -> None:
    n = SCENARIOS["epochs"]["data"]["n"]
    name = f"resume{epoch}"
    start = ranks[0][name]["from"]
    assert all(r[name]["from"] == start for r in ranks)
    full = ranks[0]["epochs"]["windows"]
    assert full[start - 1]["epoch"] == epoch == full[start]["epoch"], "checkpoint not mid-epoch"
    before = [
        i
        for r in ranks
        for w in r["epochs"]["windows"][:start]
        if w["epoch"] == epoch
        for ids in w["ids"]
        for i in ids
    ]
    after = all_ranks_epoch_ids(ranks, name, epoch)
    assert 0 < len(before) < n
    assert sorted(before + after) == list(range(n)), "resumed epoch: not every sample exactly once"
    resumed = ranks[0][name]["windows"]
    assert resumed[0]["global_step"] == start and resumed[0]["epoch"] == epoch
    assert {w["epoch"] for w in resumed} == set(range(epoch, 2)), "trained past num_train_epochs"
    if epoch == 0:
        assert sorted(all_ranks_epoch_ids(ranks, name, 1)) == list(range(n))
    # deterministic=True and the same world size: the loader replays exactly, so the
    # resumed run trains the very windows the uninterrupted run trained after `start`.
    for r in ranks:
        assert [w["ids"] for w in r[name]["windows"]] == [
            w["ids"] for w in r["epochs"]["windows"][start:]
        ]
        assert r[name]["global_step"] == r["epochs"]["global_step"]
    # Without the loader state the resumed epoch would start over: duplicates.
    assert sorted(before + all_ranks_epoch_ids(ranks, "epochs", epoch)) != list(range(n))


@distributed
def test_resume_at_an_epoch_end_starts_the_next_epoch(ranks: list[dict[str, Any]]) -> None:
    """A checkpoint saved at epoch 0's end holds a closed loader state: the resumed
    run trains epoch 1 (the same windows as the uninterrupted run) and stops; one
    saved after the last epoch trains nothing."""
    for r in ranks:
        start = r["resume_end"]["from"]
        full = r["epochs"]["windows"]
        assert full[start - 1]["epoch"] == 0 and full[start]["epoch"] == 1
        assert [w["ids"] for w in r["resume_end"]["windows"]] == [w["ids"] for w in full[start:]]
        assert r["resume_end"]["global_step"] == r["epochs"]["global_step"]
        assert r["resume_final"]["windows"] == []
        assert r["resume_final"]["global_step"] == r["epochs"]["global_step"]


@distributed
def test_max_steps_stops_after_that_many_optimizer_steps(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        run_ = r["max_steps"]
        assert run_["global_step"] == len(run_["windows"]) == 8
        assert run_["schedule"] == 8 and run_["sched_last"] == 8
        full = r["epochs"]["windows"]
        assert full[7]["epoch"] == 1, "8 steps should reach into epoch 1"
        assert [w["ids"] for w in run_["windows"]] == [w["ids"] for w in full[:8]]


@distributed
@pytest.mark.parametrize("name", ["epochs", "lr_g1"])
def test_schedule_ends_on_the_last_update(ranks: list[dict[str, Any]], name: str) -> None:
    """The Trainer's own lr_scheduler_type, on the run's progress: it starts at its
    start value and is at its final value (0) right after the last update."""
    peak = SCENARIOS[name]["args"]["learning_rate"]
    lrs = [w["lr"] for w in ranks[0][name]["windows"]]
    for r in ranks:
        run_ = r[name]
        assert run_["progress_lr"]
        assert [w["lr"] for w in run_["windows"]] == lrs
        assert run_["final_lr"] <= 1e-6 * peak
        # state.max_steps: the planned total during the run, the real count at its end.
        assert run_["max_steps"] == run_["global_step"] == len(lrs)
    if name == "lr_g1":  # linear warmup over a tenth of the run: from 0, up, then down
        assert lrs[0] == 0.0 and 0 < max(lrs) <= peak and lrs[-1] < max(lrs) / 2
    else:  # cosine from the peak, decreasing
        assert lrs[0] == peak and all(a > b for a, b in itertools.pairwise(lrs))


@distributed
@pytest.mark.parametrize("epoch", [0, 1])
def test_resume_keeps_the_schedule(ranks: list[dict[str, Any]], epoch: int) -> None:
    full = ranks[0]["epochs"]["windows"]
    for r in ranks:
        resumed = r[f"resume{epoch}"]
        got = [w["lr"] for w in resumed["windows"]]
        assert got == pytest.approx([w["lr"] for w in full[resumed["from"] :]], rel=1e-12)
        assert resumed["final_lr"] <= 1e-6 * SCENARIOS["epochs"]["args"]["learning_rate"]


@distributed
def test_resume_on_one_process_ends_on_the_last_update(
    ranks: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A checkpoint of the 2-rank run resumed by one process (2 -> 1): it goes on from
    the saved progress and still ends at 0 on its last update."""
    run0 = ranks[0]["epochs"]
    step = ranks[0]["resume1"]["from"]
    trainer, rec = make_trainer("epochs", tmp_path, save_strategy="no", ddp_backend=None)
    trainer.train(resume_from_checkpoint=str(Path(run0["root"]) / f"checkpoint-{step}"))
    lrs = [w["lr"] for w in rec.windows]
    assert lrs and lrs[0] == pytest.approx(run0["windows"][step]["lr"], rel=1e-12)
    assert all(a > b for a, b in itertools.pairwise(lrs))
    assert (
        trainer.lr_scheduler.get_last_lr()[0] <= 1e-6 * SCENARIOS["epochs"]["args"]["learning_rate"]
    )
    done = {i for w in run0["windows"][:step] if w["epoch"] == 1 for ids in w["ids"] for i in ids}
    done |= {
        i
        for r in ranks[1:]
        for w in r["epochs"]["windows"][:step]
        if w["epoch"] == 1
        for ids in w["ids"]
        for i in ids
    }
    rest = [i for w in rec.windows for ids in w["ids"] for i in ids]
    assert sorted(done | set(rest)) == list(range(SCENARIOS["epochs"]["data"]["n"]))
    assert not done & set(rest)


def run_resume_on(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """`epochs`' 2-rank checkpoint resumed on `world` ranks (gloo_ranks.launch)."""
    set_rank_env(rank, world, spec["port"], OMP_NUM_THREADS="1")
    warnings.simplefilter("ignore")
    r = run("epochs", Path(spec["out"]), resume=spec["ckpt"], save_strategy="no")
    return {
        "lrs": [w["lr"] for w in r["windows"]],
        "ids": [i for w in r["windows"] for ids in w["ids"] for i in ids],
        "final_lr": r["final_lr"],
        "global_step": r["global_step"],
        "max_steps": r["max_steps"],
    }


@distributed
def test_resume_on_three_ranks_ends_on_the_last_update(
    ranks: list[dict[str, Any]], tmp_path: Path
) -> None:
    run0 = ranks[0]["epochs"]
    step = ranks[0]["resume1"]["from"]
    spec = {
        "port": free_port(),
        "out": str(tmp_path),
        "ckpt": str(Path(run0["root"]) / f"checkpoint-{step}"),
    }
    resumed = ok(launch_ranks("test_integration_hf:run_resume_on", 3, spec, tmp_path))
    peak = SCENARIOS["epochs"]["args"]["learning_rate"]
    for r in resumed:
        assert r["lrs"] == resumed[0]["lrs"]
        assert r["lrs"][0] == pytest.approx(run0["windows"][step]["lr"], rel=1e-12)
        assert all(a > b for a, b in itertools.pairwise(r["lrs"]))
        assert r["final_lr"] <= 1e-6 * peak
        assert r["max_steps"] == r["global_step"]
    done = {
        i
        for r in ranks
        for w in r["epochs"]["windows"][:step]
        if w["epoch"] == 1
        for ids in w["ids"]
        for i in ids
    }
    rest = [i for r in resumed for i in r["ids"]]
    assert sorted([*done, *rest]) == list(range(SCENARIOS["epochs"]["data"]["n"]))


@distributed
def test_lora_g2_windows_match_single_process(ranks: list[dict[str, Any]]) -> None:
    """LoRA under ODBHFTrainer, G=2: each window's gradient, on the adapter weights
    only, is the per-token mean's; the per-micro-step normalisation misses it."""
    windows = ranks[0]["g2_lora"]["windows"]
    ref = Reference(lora_llama(seed=0), ChatSFT(**SCENARIOS["g2_lora"]["data"]))
    adapter = torch.cat(
        [torch.full((p.numel(),), "lora_" in n) for n, p in ref.model.named_parameters()]
    )
    for w in (0, len(windows) - 1):
        grad = windows[w]["grad"]
        assert (grad[~adapter] == 0).all() and (grad[adapter] != 0).any()
        err = rel_l2(grad, ref.mean(window_ids(ranks, "g2_lora", w)))
        print(f"[g2_lora] window {w} rel L2 {err:.3g}")
        assert err <= TOL
    wrong = rel_l2(
        per_micro_step_mean(ref, ranks, "g2_lora", 0), ref.mean(window_ids(ranks, "g2_lora", 0))
    )
    print(f"[g2_lora] window 0, per-micro-step normalisation rel L2 {wrong:.3g}")
    assert wrong > WRONG


class AdapterAtStart(TrainerCallback):
    """The adapter weights as training starts (after a checkpoint was loaded)."""

    def __init__(self) -> None:
        self.weights: dict[str, Any] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.weights = {
            n: p.detach().clone() for n, p in kw["model"].named_parameters() if "lora_" in n
        }


def check_adapter_resumed(start: dict[str, Any], ckpt: Path) -> None:
    """`start` (the adapter as the resumed run began) is the checkpoint's adapter."""
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "adapter_model.safetensors"))
    assert len(saved) == len(start) > 0
    by_suffix = {k.split("base_model.model.")[-1]: v for k, v in saved.items()}
    for name, value in start.items():
        key = name.split("base_model.model.")[-1].replace(".default", "")
        assert torch.equal(value.to(by_suffix[key].dtype), by_suffix[key]), f"{name} not loaded"


@distributed
def test_lora_adapter_only_checkpoint_resumes_on_one_process(
    ranks: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The 2-rank LoRA run's checkpoints hold the adapter only; one inside epoch 1,
    resumed by one process (2 -> 1), loads it, and trains each of the epoch's
    remaining samples once. The check fails on a fresh adapter (not loaded)."""
    run0 = ranks[0]["epochs_lora"]
    every = SCENARIOS["epochs_lora"]["args"]["save_steps"]
    step = _checkpoint_inside(run0["windows"], 1, every)
    ckpt = Path(run0["root"]) / f"checkpoint-{step}"
    names = {p.name for p in ckpt.iterdir()}
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names, names
    trainer, rec = make_trainer("epochs_lora", tmp_path, save_strategy="no", ddp_backend=None)
    start = AdapterAtStart()
    trainer.add_callback(start)
    trainer.train(resume_from_checkpoint=str(ckpt))
    check_adapter_resumed(start.weights, ckpt)
    fresh = {n: p.detach() for n, p in lora_llama(seed=0).named_parameters() if "lora_" in n}
    with pytest.raises(AssertionError, match="not loaded"):
        check_adapter_resumed(fresh, ckpt)
    done = {
        i
        for r in ranks
        for w in r["epochs_lora"]["windows"][:step]
        if w["epoch"] == 1
        for ids in w["ids"]
        for i in ids
    }
    rest = [i for w in rec.windows for ids in w["ids"] for i in ids]
    assert sorted([*done, *rest]) == list(range(SCENARIOS["epochs_lora"]["data"]["n"]))


# ---- the runnable example ------------------------------------------------------------------


def _example(tmp_path: Path, *extra: str) -> str:
    example = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer_sft.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(example), "--samples", "120", "--output-dir", str(tmp_path / "out"), *extra]
    proc = run_script(cmd, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@distributed
def test_example_runs_under_torchrun_and_resumes(tmp_path: Path) -> None:
    """`torchrun --nproc_per_node 2 examples/hf_trainer_sft.py`: 2 epochs of every
    sample, windows of 2 steps (the last short), the loss falls; then a resume from
    its last checkpoint with --epochs 3 trains only epoch 2."""
    line = (
        r"epoch (\d): (\d+) aligned steps, (\d+) optimizer updates, (\d+) samples, "
        r"mean loss ([\d.]+)"
    )
    out = _example(tmp_path, "--save-steps", "4")
    epochs = [tuple(float(x) for x in m) for m in re.findall(line, out)]
    assert [(e[0], e[3]) for e in epochs] == [(0, 120), (1, 120)], out
    for _, steps, updates, _, _ in epochs:
        assert updates == math.ceil(steps / 2), out
    assert epochs[1][4] < epochs[0][4], out
    assert "done on 2 ranks" in out
    out = _example(tmp_path, "--resume", "--epochs", "3")
    assert [m[0] for m in re.findall(line, out)] == ["2"], out


# ---- bad input (one process) -------------------------------------------------------------


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "_warned", set())


def _args(tmp_path: Path, **kw: Any) -> Any:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)


def _trainer(tmp_path: Path, args: Any = None, **kw: Any) -> Any:
    opts = {
        "model": tiny_llama(seed=0),
        "args": args if args is not None else _args(tmp_path),
        "train_dataset": ChatSFT(8),
        "data_collator": pad_collate,
        "odb": {"token_budget": 256},
        **kw,
    }
    return ODBHFTrainer(**opts)


def test_one_process_trains_whole_epochs_and_evaluates(tmp_path: Path) -> None:
    """No process group: the same trainer on one process, with an eval set (the
    Trainer's own loss and loader there), G=2 and a cosine schedule."""
    args = _args(
        tmp_path,
        num_train_epochs=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        eval_strategy="epoch",
        per_device_eval_batch_size=4,
        disable_tqdm=False,
    )
    rec = Recorder(grads=False)
    trainer = _trainer(
        tmp_path,
        args=args,
        train_dataset=ChatSFT(24, seed=1),
        eval_dataset=ChatSFT(8, seed=9),
        odb={"token_budget": 192, "seed": 3},
        callbacks=[rec],
    )
    rec.trainer = trainer
    out = trainer.train()
    for epoch in (0, 1):
        ids = [i for w in rec.windows if w["epoch"] == epoch for ids in w["ids"] for i in ids]
        assert sorted(ids) == list(range(24))
    assert out.global_step == len(rec.windows)
    assert trainer.state.epoch == pytest.approx(2.0)
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 2 and all(math.isfinite(x) for x in evals)
    assert isinstance(trainer.lr_scheduler, ProgressLR)
    assert trainer.lr_scheduler.get_last_lr()[0] <= 1e-9  # cosine to 0 on the last update
    # The progress bar shows the planned total (the loader's central estimate), not
    # the Trainer's step cap (2 x 13); at the end state.max_steps is the real count.
    planned = trainer._odb_planned_updates
    assert rec.bar_totals and rec.bar_totals[0] == planned
    assert abs(planned - out.global_step) <= 2, (planned, out.global_step)
    assert trainer.state.max_steps == out.global_step


def test_checkpoint_without_loader_state_is_rejected(tmp_path: Path) -> None:
    args = _args(tmp_path, num_train_epochs=1, save_strategy="epoch", disable_tqdm=True)
    trainer = _trainer(tmp_path, args=args, train_dataset=ChatSFT(12, seed=1))
    out = trainer.train()
    ckpt = tmp_path / f"checkpoint-{out.global_step}"
    state = ckpt / "odb_loader_states.json"
    assert state.exists() and (ckpt / "odb_trainer.json").exists()
    state.unlink()  # as in a checkpoint a plain Trainer wrote
    again = _trainer(tmp_path, args=args, train_dataset=ChatSFT(12, seed=1))
    with pytest.raises(ConfigError, match="no ODB loader state"):
        again.train(resume_from_checkpoint=str(ckpt))


def test_checkpoint_of_the_old_per_rank_files_still_resumes(tmp_path: Path) -> None:
    """odb-core before one checkpoint format wrote `odb_loader_rank{r}.json`: read once;
    a tampered one is refused before anything is applied."""
    import json

    args = _args(tmp_path, num_train_epochs=2, save_strategy="epoch", disable_tqdm=True)
    trainer = _trainer(tmp_path, args=args, train_dataset=ChatSFT(12, seed=1))
    trainer.train()
    ckpt = min(tmp_path.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    entry = json.loads((ckpt / "odb_loader_states.json").read_text())
    assert entry["format"] == "odb-loader-states" and entry["world_size"] == 1
    (ckpt / "odb_loader_states.json").unlink()
    old = ckpt / "odb_loader_rank0.json"
    old.write_text(json.dumps({**entry["ranks"][0], "step": 0}))  # checksum broken
    again = _trainer(tmp_path, args=args, train_dataset=ChatSFT(12, seed=1))
    with pytest.raises(ConfigError, match="checksum"):
        again.train(resume_from_checkpoint=str(ckpt))
    old.write_text(json.dumps(entry["ranks"][0]))
    again = _trainer(tmp_path, args=args, train_dataset=ChatSFT(12, seed=1))
    again.train(resume_from_checkpoint=str(ckpt))
    assert again.odb_loader is not None and again.odb_loader.epoch == 1


def test_clamped_schedule_never_steps_past_its_end() -> None:
    """A cosine schedule stepped past its end comes back up; clamped, it stays at 0."""
    from transformers import get_cosine_schedule_with_warmup

    def lrs(clamp: bool) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched: Any = get_cosine_schedule_with_warmup(opt, 0, 10)
        if clamp:
            sched = hf.ClampedLR(sched, 10)
        out = []
        for _ in range(15):
            opt.step()
            sched.step()
            out.append(sched.get_last_lr()[0])
        return out

    clamped, plain = lrs(True), lrs(False)
    assert clamped[:10] == plain[:10] and clamped[9] == pytest.approx(0.0, abs=1e-12)
    assert clamped[10:] == [clamped[9]] * 5
    assert plain[-1] > 0.1  # the failure the clamp prevents


def test_plain_dataloader_is_rejected(tmp_path: Path) -> None:
    loader = torch.utils.data.DataLoader(ChatSFT(8), batch_size=2)
    with pytest.raises(ConfigError, match=r"train_dataset is a DataLoader.*Pass the dataset"):
        _trainer(tmp_path, train_dataset=loader)


def test_overridden_train_dataloader_is_rejected(tmp_path: Path) -> None:
    class Plain(ODBHFTrainer):
        def get_train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=2)

    trainer = Plain(
        model=tiny_llama(seed=0),
        args=_args(tmp_path, num_train_epochs=1),
        train_dataset=ChatSFT(8),
        data_collator=pad_collate,
        odb={"token_budget": 256},
    )
    with pytest.raises(ConfigError, match=r"must be the one its get_train_dataloader"):
        trainer.train()


def test_a_plain_trainer_iterating_an_odb_loader_warns_naming_odbhftrainer(
    tmp_path: Path,
) -> None:
    """Upgrade trap: a plain Trainer sizes its loop from len(loader), an estimate (with
    max_steps=30 it stopped at 24, silently)."""
    from transformers import Trainer

    from odb_core import ODBDataLoader

    class Plain(Trainer):
        def get_train_dataloader(self) -> Any:
            return ODBDataLoader(self.train_dataset, token_budget=256, collate_fn=pad_collate)

    trainer = Plain(
        model=tiny_llama(seed=0),
        args=_args(tmp_path, max_steps=2, save_strategy="no"),
        train_dataset=ChatSFT(8),
        data_collator=pad_collate,
    )
    with pytest.warns(UserWarning, match=r"plain Plain.*max_steps=2.*ODBHFTrainer"):
        trainer.train()


def test_the_old_name_is_a_deprecated_alias() -> None:
    with pytest.warns(DeprecationWarning, match="use ODBHFTrainer"):
        assert hf.ODBTrainer is ODBHFTrainer


def test_drop_last_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dataloader_drop_last=False"):
        _trainer(tmp_path, args=_args(tmp_path, dataloader_drop_last=True))


def test_batch_size_is_ignored_with_one_warning(tmp_path: Path, fresh_warnings: None) -> None:
    args = _args(tmp_path, per_device_train_batch_size=4)
    with pytest.warns(UserWarning, match="per_device_train_batch_size=4 is ignored.*token_budget"):
        _trainer(tmp_path, args=args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _trainer(tmp_path, args=args)  # once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _trainer(tmp_path)  # the default is not "set"


def test_fractional_epochs_and_owned_options_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="whole number"):
        _trainer(tmp_path, args=_args(tmp_path, num_train_epochs=1.5))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        _trainer(tmp_path, odb={"token_budget": 256, "grad_accum_steps": 2})
    with pytest.raises(ConfigError, match="not supported"):
        _trainer(tmp_path, odb={"token_budget": 256, "tokens_per_update": 100})
    with pytest.raises(ConfigError, match="token_budget"):
        _trainer(tmp_path, odb={"shuffle": True})


def test_version_outside_range_warns_once(fresh_warnings: None) -> None:
    assert hf.check_transformers_version(transformers.__version__)
    with pytest.warns(UserWarning, match=r"transformers 5\.0\.0 is outside the range"):
        assert not hf.check_transformers_version("5.0.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not hf.check_transformers_version("5.0.0")


def test_supported_range_matches_the_hf_extra() -> None:
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["hf"]
    (req,) = [Requirement(r) for r in extra if Requirement(r).name == "transformers"]
    assert transformers.__version__ in req.specifier
    ours = SpecifierSet(hf.SUPPORTED_TRANSFORMERS)
    # Every release the extra allows is in the adapter's fallback range (the one it
    # uses when odb-core's installed metadata does not name the extra).
    for v in ("5.23.9", "5.24.0", "5.24.3", "5.25.0", "6.0.0"):
        if Version(v) in req.specifier:
            assert Version(v) in ours, v


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))
