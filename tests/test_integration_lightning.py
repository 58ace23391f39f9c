"""Lightning adapter on real processes: 2 gloo ranks, CPU, a tiny float64
`LlamaForCausalLM`, masked-prompt SFT labels, long-tail lengths.

The test launches two processes itself, joins them in a gloo group, and lets
Lightning attach to it (`LOCAL_RANK` etc. in the environment, so Lightning's
environment does not spawn; `DDPStrategy(process_group_backend="gloo")` finds the
group initialised). In each rank, one `ODBLightningTrainer` fit per case:

- `epochs`: 2 epochs, shuffled, padded batches, transformers' loss, accumulation 1;
- `accum2`: `accumulate_grad_batches=2`, packed rows, unshuffled skewed shards
  (rank 1 runs dry and pads), fully masked samples, `causal_lm_loss`;
- `resume`: accumulation 2; a `ModelCheckpoint(every_n_train_steps=2)` run that
  stops after that checkpoint, then a fresh Trainer/DataModule/model resumed with
  `trainer.fit(..., ckpt_path=...)` to the end of the epoch;
- `lr_g1`, `lr_g2`, `lr_resume`: SGD at a real learning rate under a `ProgressLR`
  returned from `configure_optimizers` (interval "step"), 2 epochs: it ends at its
  final value on the last update; `lr_resume` stops at a checkpoint inside epoch
  1, resumed on 2 ranks here and on 1 and 3 ranks by `run_lr_resume`.

The optimizer is SGD with lr=0, so the parameters stay at their seeded init and
the gradient of every optimizer window (recorded in `on_before_optimizer_step`,
after DDP's all-reduce) can be compared with one process's per-token mean over
the window's samples (`sft_support.Reference`). Every batch carries its sample
ids (the collate adds them), which `training_step` compares with the in-band
metadata it pops.
"""

from __future__ import annotations

import itertools
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
pytest.importorskip("transformers")
pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from gloo_ranks import launch as launch_ranks  # noqa: E402
from gloo_ranks import launch_entry, ok  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from sft_support import (  # noqa: E402
    MODELS,
    ChatSFT,
    Reference,
    flat_grad,
    loss_tokens,
    pack_collate,
    pad_collate,
    rel_l2,
)
from torch.utils.data import DataLoader  # noqa: E402

from odb_core.bench.launch import free_port, init_local_gloo, release_child_resources  # noqa: E402
from odb_core.errors import ConfigError  # noqa: E402
from odb_core.idset import decode  # noqa: E402
from odb_core.integrations import lightning as odb_pl  # noqa: E402
from odb_core.integrations.lightning import (  # noqa: E402
    ODBDataModule,
    ODBLightningTrainer,
    check_lightning_version,
    lightning_loss,
)
from odb_core.schedule import Schedule  # noqa: E402
from odb_core.torch import ProgressLR, causal_lm_loss, pop_step_meta, scaled_loss  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORLD = 2
TOL = 1e-6
WRONG = 1e-4
RESUME_AT = 2  # optimizer steps before the checkpoint of the resume case

COMMON = {"deterministic": True, "buffer_size": 16, "max_steps_per_round": 4}

CASES: dict[str, dict[str, Any]] = {
    "epochs": {
        "data": {"n": 64, "seed": 1},
        "collate": "padded",
        "loss": "hf",
        "epochs": 2,
        "accumulate": 1,
        "loader": {"cost_model": "padded", "token_budget": 256, "shuffle": True, "seed": 5},
    },
    "accum2": {
        "data": {"n": 48, "seed": 2, "skew": True, "masked_every": 7},
        "collate": "packed",
        "loss": "causal_lm",
        "epochs": 1,
        "accumulate": 2,
        "loader": {"cost_model": "packed", "token_budget": 352, "shuffle": False},
    },
    # PEFT LoRA (`sft_support.lora_llama`) on accum2's data and loader.
    "accum2_lora": {
        "data": {"n": 48, "seed": 2, "skew": True, "masked_every": 7},
        "collate": "packed",
        "loss": "causal_lm",
        "epochs": 1,
        "accumulate": 2,
        "model": "lora",
        "loader": {"cost_model": "packed", "token_budget": 352, "shuffle": False},
    },
    "resume": {
        "data": {"n": 56, "seed": 3},
        "collate": "padded",
        "loss": "hf",
        "epochs": 1,
        "accumulate": 2,
        "loader": {"cost_model": "padded", "token_budget": 160, "shuffle": True, "seed": 9},
    },
    # manual optimization: windows closed on global loss tokens, stepped on sync_gradients
    "manual": {
        "data": {"n": 48, "seed": 5, "skew": True, "masked_every": 9},
        "collate": "packed",
        "loss": "causal_lm",
        "epochs": 1,
        "accumulate": 1,
        "manual": True,
        "loader": {
            "cost_model": "packed",
            "token_budget": 352,
            "shuffle": False,
            "tokens_per_update": 160,
        },
    },
    # a progress-driven schedule (ProgressLR) at a real learning rate
    "lr_g1": {
        "data": {"n": 40, "seed": 6},
        "collate": "padded",
        "loss": "hf",
        "epochs": 2,
        "accumulate": 1,
        "schedule": {"shape": "linear"},
        "loader": {"cost_model": "padded", "token_budget": 256, "shuffle": True, "seed": 3},
    },
    "lr_g2": {
        "data": {"n": 40, "seed": 7},
        "collate": "padded",
        "loss": "hf",
        "epochs": 2,
        "accumulate": 2,
        "schedule": {"shape": "cosine", "warmup": 0.2},
        "loader": {"cost_model": "padded", "token_budget": 160, "shuffle": True, "seed": 4},
    },
    "lr_resume": {
        "data": {"n": 40, "seed": 8},
        "collate": "padded",
        "loss": "hf",
        "epochs": 2,
        "accumulate": 2,
        "schedule": {"shape": "linear"},
        "loader": {"cost_model": "padded", "token_budget": 160, "shuffle": True, "seed": 6},
    },
    # a checkpoint at the end of epoch 0, resumed into epoch 1
    "resume_end": {
        "data": {"n": 40, "seed": 4},
        "collate": "padded",
        "loss": "hf",
        "epochs": 2,
        "accumulate": 1,
        "loader": {"cost_model": "padded", "token_budget": 256, "shuffle": True, "seed": 11},
    },
}


# ---- what runs inside a rank ----------------------------------------------------------


class IdChat(ChatSFT):
    """ChatSFT whose samples carry their index, so a batch knows its own ids."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**super().__getitem__(i), "idx": i}


def _with_ids(collate: Any) -> Any:
    def fn(samples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = collate(samples)
        batch["sample_ids"] = torch.tensor([s["idx"] for s in samples])
        return batch

    return fn


COLLATES = {"padded": _with_ids(pad_collate), "packed": _with_ids(pack_collate)}


PEAK = 1e-3
LR_RESUME_AT = 5  # optimizer steps before the checkpoint of lr_resume (inside epoch 1)


class SFT(pl.LightningModule):
    def __init__(
        self, loss: str, manual: bool = False, schedule: Any = None, model: str = "full"
    ) -> None:
        super().__init__()
        self.schedule = schedule
        self.model = MODELS[model](seed=0)
        self.loss_kind = loss
        self.automatic_optimization = not manual
        self.steps: list[dict[str, Any]] = []
        self.estimate: Any = None

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        info = self.trainer.datamodule.loader.step_info  # stale under Lightning's prefetch
        meta = pop_step_meta(batch)
        ids = [int(i) for i in batch.pop("sample_ids")]
        labels = batch["labels"]
        own_loss_tokens = int((labels[..., 1:] != -100).sum())
        if self.loss_kind == "hf":
            loss = scaled_loss(meta, self.model(**batch).loss)
        else:
            labels = batch.pop("labels")
            loss = causal_lm_loss(meta, self.model(**batch).logits, labels)
        self.steps.append(
            {
                "epoch": self.current_epoch,
                "batch_idx": batch_idx,
                "step": meta.step,
                "window": meta.window,
                "is_pad": meta.is_pad,
                "sync": meta.sync_gradients,
                "ids": ids,
                "local_samples": meta.local_samples,
                "global_samples": meta.global_samples,
                "local_loss_tokens": meta.local_loss_tokens,
                "global_loss_tokens": meta.global_loss_tokens,
                "own_loss_tokens": own_loss_tokens,
                "loss_scale": float(meta.loss_scale),
                "info_step": None if info is None else info.step,
                "info_ids": None if info is None else [int(i) for i in info.sample_ids],
                "global_step": self.trainer.global_step,
            }
        )
        if self.automatic_optimization:
            return lightning_loss(self, loss)
        self.manual_backward(lightning_loss(self, loss))  # unchanged in manual optimization
        if meta.sync_gradients:
            opt = self.optimizers()
            opt.step()
            opt.zero_grad()
        return None

    def configure_optimizers(self) -> Any:
        self.estimate = self.trainer.estimated_stepping_batches
        if self.schedule is None:
            return torch.optim.SGD(self.parameters(), lr=0.0)
        opt = torch.optim.SGD(self.parameters(), lr=PEAK)
        dm = self.trainer.datamodule
        sched = ProgressLR(opt, dm, epochs=self.trainer.max_epochs, **self.schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(Callback):
    """Gradients at each optimizer step; the state a naive checkpoint would save."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.grads: list[torch.Tensor] = []
        self.steps_at_grad: list[int] = []
        self.stop_at = stop_at
        self.naive_done: list[int] | None = None
        self.num_training_batches: Any = None
        self.checked_states = 0
        self.lrs: list[float] = []  # the rate each optimizer step used
        self.progress: list[float] = []  # the run's progress once its window is done

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.num_training_batches = trainer.num_training_batches

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grads.append(flat_grad(pl_module.model))
        self.steps_at_grad.append(len(pl_module.steps) - 1)
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))
        if pl_module.schedule is not None:
            self.progress.append(trainer.datamodule.run_progress.fraction(trainer.max_epochs))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        # the checkpoint state (the prefetched batch taken back) is always derivable
        trainer.datamodule.passes.state()
        self.checked_states += 1
        if self.stop_at is not None and trainer.global_step == self.stop_at:
            # What Lightning's own stateful-loader path would save: the loader's state
            # now, after its prefetched batch (and only rank 0's).
            self.naive_done = sorted(decode(trainer.datamodule.loader.state_dict()["done"], "done"))
            trainer.should_stop = True


def _trainer(
    case: dict[str, Any], root: Path, callbacks: list[Any], world: int = WORLD
) -> pl.Trainer:
    return ODBLightningTrainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy=DDPStrategy(process_group_backend="gloo") if world > 1 else "auto",
        max_epochs=case["epochs"],
        accumulate_grad_batches=case["accumulate"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=callbacks,
    )


def _datamodule(case: dict[str, Any]) -> ODBDataModule:
    dm = ODBDataModule(
        IdChat(**case["data"]),
        collate_fn=COLLATES[case["collate"]],
        **{**COMMON, **case["loader"]},
    )
    return dm


def _fit(
    case: dict[str, Any],
    root: Path,
    *,
    stop_at: int | None = None,
    ckpt_path: str | None = None,
    epoch_ckpt: bool = False,
    max_epochs: int | None = None,
    world: int = WORLD,
) -> dict[str, Any]:
    recorder = Recorder(stop_at)
    callbacks: list[Any] = [recorder]
    if stop_at is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=stop_at, save_top_k=-1)
        )
    if epoch_ckpt:  # saved at each epoch's end
        callbacks.append(ModelCheckpoint(dirpath=str(root / "ckpt"), save_top_k=-1))
    if max_epochs is not None:
        case = {**case, "epochs": max_epochs}
    trainer = _trainer(case, root, callbacks, world)
    module = SFT(
        case["loss"],
        manual=case.get("manual", False),
        schedule=case.get("schedule"),
        model=case.get("model", "full"),
    )
    dm = _datamodule(case)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    configs = trainer.lr_scheduler_configs
    return {
        "lrs": recorder.lrs,
        "progress": recorder.progress,
        "final_lr": float(configs[0].scheduler.get_last_lr()[0]) if configs else None,
        "steps": module.steps,
        "grads": torch.stack(recorder.grads) if recorder.grads else torch.zeros(0),
        "steps_at_grad": recorder.steps_at_grad,
        "global_step": trainer.global_step,
        "estimate": module.estimate,
        "num_training_batches": recorder.num_training_batches,
        "naive_done": recorder.naive_done,
        "epoch_steps": dict(getattr(dm.loader, "epoch_steps", {})),
        "window_steps": dm.window_steps,
        "checked_states": recorder.checked_states,
    }


def _rank_entry(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    init_local_gloo(rank, world, port, timeout_s=HANG_GUARD_S)
    try:
        root = Path(out)
        result: dict[str, Any] = {"times": {}}
        for name in ("epochs", "accum2", "accum2_lora", "manual"):
            t0 = time.perf_counter()
            result[name] = _fit(CASES[name], root / name)
            result["times"][name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        case = CASES["resume"]
        first = _fit(case, root / "resume", stop_at=RESUME_AT)
        torch.distributed.barrier()
        (ckpt,) = sorted((root / "resume" / "ckpt").glob("*.ckpt"))
        second = _fit(case, root / "resume2", ckpt_path=str(ckpt))
        result["resume"] = {"first": first, "second": second, "ckpt": ckpt.name}
        result["times"]["resume"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        case = CASES["resume_end"]
        first = _fit(case, root / "resume_end", epoch_ckpt=True, max_epochs=1)
        torch.distributed.barrier()
        (ckpt,) = sorted((root / "resume_end" / "ckpt").glob("*.ckpt"))
        second = _fit(case, root / "resume_end2", ckpt_path=str(ckpt))
        result["resume_end"] = {"first": first, "second": second, "ckpt": ckpt.name}
        result["times"]["resume_end"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for name in ("lr_g1", "lr_g2"):
            result[name] = _fit(CASES[name], root / name)
        case = CASES["lr_resume"]
        first = _fit(case, root / "lr_resume", stop_at=LR_RESUME_AT)
        torch.distributed.barrier()
        (ckpt,) = sorted((root / "lr_resume" / "ckpt").glob("*.ckpt"))
        second = _fit(case, root / "lr_resume2", ckpt_path=str(ckpt))
        result["lr_resume"] = {"first": first, "second": second, "ckpt": str(ckpt)}
        result["times"]["lr"] = time.perf_counter() - t0
        torch.save(result, Path(out, f"rank{rank}.pt"))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
    release_child_resources()
    os._exit(0)


def launch(out: Path, timeout: float = HANG_GUARD_S) -> list[dict[str, Any]]:
    return launch_entry(_rank_entry, WORLD, out, timeout=timeout)


# ---- the parent's view -------------------------------------------------------------------


class Run:
    """Both ranks' records of one fit, and the single-process reference."""

    def __init__(self, per_rank: list[dict[str, Any]], case: dict[str, Any], ref: Reference):
        self.case = case
        self.steps = [r["steps"] for r in per_rank]
        self.grads = [r["grads"] for r in per_rank]
        self.at_grad = [r["steps_at_grad"] for r in per_rank]
        self.raw = per_rank
        self.ref = ref
        self.dataset = ref.dataset
        assert len(self.steps[0]) == len(self.steps[1]), "ranks ran different step counts"
        windows: list[list[int]] = []
        for t in range(len(self.steps[0])):
            if not windows or self.steps[0][t - 1]["sync"]:
                windows.append([])
            windows[-1].append(t)
        self.windows = windows  # indices into steps, per optimizer window

    def ids(self, ts: list[int], rank: int | None = None) -> list[int]:
        ranks = range(WORLD) if rank is None else [rank]
        return [
            i
            for t in ts
            for r in ranks
            if not self.steps[r][t]["is_pad"]
            for i in self.steps[r][t]["ids"]
        ]

    def error(self, w: int) -> float:
        return rel_l2(self.grads[0][w], self.ref.mean(self.ids(self.windows[w])))

    def unscaled_local_mean(self, w: int) -> torch.Tensor:
        total = torch.zeros_like(self.grads[0][w])
        for t in self.windows[w]:
            for r in range(WORLD):
                ids = self.ids([t], r)
                g, n = self.ref.summed(ids) if ids else (None, 0)
                if n:
                    total += (g / n) / WORLD
        return total


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    t0 = time.perf_counter()
    per_rank = launch(tmp_path_factory.mktemp("lightning"))
    models = {kind: build(seed=0) for kind, build in MODELS.items()}
    model = models["full"]
    out: dict[str, Any] = {}
    for name in ("epochs", "accum2", "accum2_lora", "manual"):
        case = CASES[name]
        ref = Reference(models[case.get("model", "full")], ChatSFT(**case["data"]))
        out[name] = Run([r[name] for r in per_rank], case, ref)
    for name in ("resume", "resume_end"):
        case = CASES[name]
        ref = Reference(model, ChatSFT(**case["data"]))
        out[name] = {
            part: Run([r[name][part] for r in per_rank], case, ref) for part in ("first", "second")
        }
    out["lr"] = {name: [r[name] for r in per_rank] for name in ("lr_g1", "lr_g2", "lr_resume")}
    print(f"\nlightning launch {time.perf_counter() - t0:.1f}s; per case {per_rank[0]['times']}")
    return out


def _all_runs(runs: dict[str, Any]) -> list[tuple[str, Run]]:
    return [(name, runs[name]) for name in ("epochs", "accum2", "manual")] + [
        (f"{name}/{k}", v) for name in ("resume", "resume_end") for k, v in runs[name].items()
    ]


# ---- metadata, coverage, steps ------------------------------------------------------------


def test_training_step_sees_its_own_batch_metadata_under_prefetch(runs: dict[str, Any]) -> None:
    stale = 0
    for name, run in _all_runs(runs):
        for r in range(WORLD):
            rows = run.steps[r]
            for t, row in enumerate(rows):
                real = [] if row["is_pad"] else row["ids"]
                assert row["local_samples"] == len(real), (name, r, t)
                if not row["is_pad"]:
                    assert row["own_loss_tokens"] == row["local_loss_tokens"], (name, r, t)
                    assert row["local_loss_tokens"] == sum(
                        loss_tokens(run.dataset[i]) for i in real
                    )
                assert row["step"] == row["batch_idx"], (name, r, t)  # continues after resume
                # loader.step_info describes the prefetched batch, one ahead
                if row["info_step"] != row["step"]:
                    assert row["info_step"] == row["step"] + 1
                    stale += 1
                    assert row["info_ids"] != row["ids"] or row["is_pad"]
        for t in range(len(run.steps[0])):
            pair = [run.steps[r][t] for r in range(WORLD)]
            for key in ("step", "window", "sync", "global_samples", "global_loss_tokens"):
                assert pair[0][key] == pair[1][key], (name, t, key)
            assert sum(p["local_samples"] for p in pair) == pair[0]["global_samples"]
    assert stale > 20, "loader.step_info should be stale under Lightning's prefetch"


def test_exactly_once_in_each_of_two_epochs_with_different_orders(runs: dict[str, Any]) -> None:
    run = runs["epochs"]
    orders = []
    for epoch in (0, 1):
        ts = [t for t, row in enumerate(run.steps[0]) if row["epoch"] == epoch]
        assert ts, f"epoch {epoch} ran no step"
        ids = run.ids(ts)
        assert sorted(ids) == list(range(len(run.dataset))), f"epoch {epoch} not exactly once"
        orders.append(run.ids(ts, 0))
    assert orders[0] != orders[1], "the two epochs ran the same order"
    accum = runs["accum2"]
    assert sorted(accum.ids(list(range(len(accum.steps[0]))))) == list(range(len(accum.dataset)))


def test_equal_optimizer_steps_and_the_windows_lightning_stepped(runs: dict[str, Any]) -> None:
    for name, run in _all_runs(runs):
        counts = [len(g) for g in run.grads]
        assert counts[0] == counts[1] == len(run.windows), (name, counts, len(run.windows))
        assert run.raw[0]["global_step"] == run.raw[1]["global_step"]
        # Lightning stepped right after each window's closing step, also the epoch's last
        assert run.at_grad[0] == [w[-1] for w in run.windows], name
    accum = runs["accum2"]
    assert all(len(w) == 2 for w in accum.windows[:-1])
    assert len(accum.windows[-1]) == 1, "the epoch should end in a short window (stepped too)"
    per_epoch_last = runs["epochs"]
    assert all(len(w) == 1 for w in per_epoch_last.windows)


def test_estimated_stepping_batches_has_a_value(runs: dict[str, Any]) -> None:
    for name, run in _all_runs(runs):
        est = [r["estimate"] for r in run.raw]
        assert est[0] == est[1] and isinstance(est[0], int) and est[0] > 0, (name, est)
        # Lightning itself sees no length (it would cut the epoch there) ...
        assert run.raw[0]["num_training_batches"] == float("inf")
    # ... and the estimate is an upper one for these runs
    for name in ("epochs", "accum2", "manual"):
        run = runs[name]
        assert run.raw[0]["global_step"] <= run.raw[0]["estimate"], name


# ---- learning-rate schedules on the run's progress -----------------------------------------


def _progress_of(steps: list[dict[str, Any]], n: int, epochs: int) -> list[float]:
    """The run's progress after each optimizer window, from the steps' own in-band
    metadata (global samples), independently of the adapter."""
    out, done, epoch = [], 0, 0
    for row in steps:
        if row["epoch"] != epoch:
            epoch, done = row["epoch"], 0
        done += row["global_samples"]
        if row["sync"]:
            out.append((epoch * n + done) / (epochs * n))
    return out


def _rates_follow_progress(
    run: dict[str, Any], name: str, before_run: list[dict[str, Any]] | None = None
) -> None:
    """The adapter's progress is the one of the batch that trained (not of the one
    Lightning prefetched), and each update used the rate of the progress after the
    update before it."""
    case = CASES[name]
    earlier = before_run or []
    progress = _progress_of(earlier + run["steps"], case["data"]["n"], case["epochs"])
    skip = len(progress) - len(run["lrs"])
    assert run["progress"] == pytest.approx(progress[skip:], abs=1e-15)
    before = [0.0, *progress][skip:-1]
    want = [PEAK * Schedule(**case["schedule"]).multiplier(p) for p in before]
    assert run["lrs"] == pytest.approx(want, abs=1e-15)


@pytest.mark.parametrize("name", ["lr_g1", "lr_g2"])
def test_progress_lr_ends_on_the_last_update(runs: dict[str, Any], name: str) -> None:
    per_rank = runs["lr"][name]
    for r in per_rank:
        assert r["lrs"] == per_rank[0]["lrs"]
        assert len(r["lrs"]) == r["global_step"] >= 4
        assert r["progress"][-1] == 1.0
        assert r["final_lr"] <= 1e-6 * PEAK
        _rates_follow_progress(r, name)
    assert per_rank[0]["lrs"][0] == (PEAK if name == "lr_g1" else 0.0)


def test_progress_lr_resumed_on_two_ranks(runs: dict[str, Any]) -> None:
    for r in runs["lr"]["lr_resume"]:
        first, second = r["first"], r["second"]
        assert len(first["lrs"]) == LR_RESUME_AT
        assert first["progress"][-1] > 0.5, "the checkpoint should be inside epoch 1"
        assert second["lrs"][0] == pytest.approx(first["final_lr"], rel=1e-12)
        rates = first["lrs"] + second["lrs"]
        assert all(a > b for a, b in itertools.pairwise(rates))
        assert second["final_lr"] <= 1e-6 * PEAK
        _rates_follow_progress(second, "lr_resume", first["steps"])


def run_lr_resume(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Resume `lr_resume`'s 2-rank checkpoint on `world` ranks (gloo_ranks.launch)."""
    os.environ.update(
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec["port"]),
    )
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    out = _fit(CASES["lr_resume"], Path(spec["root"]), ckpt_path=spec["ckpt"], world=world)
    return {k: out[k] for k in ("lrs", "progress", "final_lr", "global_step", "steps")}


@pytest.mark.parametrize("world", [1, 3])
def test_progress_lr_resumed_at_another_world_size(
    runs: dict[str, Any], world: int, tmp_path: Path
) -> None:
    first = runs["lr"]["lr_resume"][0]["first"]
    spec = {"ckpt": runs["lr"]["lr_resume"][0]["ckpt"], "root": str(tmp_path), "port": free_port()}
    resumed = ok(launch_ranks("test_integration_lightning:run_lr_resume", world, spec, tmp_path))
    for r in resumed:
        assert r["lrs"] == resumed[0]["lrs"]
        assert r["lrs"][0] == pytest.approx(first["final_lr"], rel=1e-12)
        assert r["final_lr"] <= 1e-6 * PEAK
    # Every rank's share of the resumed steps, merged into one global sequence: rank
    # 0's rows carry the global counts, the same on every rank.
    _rates_follow_progress(resumed[0], "lr_resume", first["steps"])


# ---- gradients ------------------------------------------------------------------------------


def test_first_optimizer_step_gradient_accumulation_1(runs: dict[str, Any]) -> None:
    run = runs["epochs"]
    err = run.error(0)
    print(f"[epochs] window 0 rel L2 {err:.3g}")
    assert err <= TOL
    worst = max(run.error(w) for w in range(len(run.windows)))
    print(f"[epochs] max rel L2 over {len(run.windows)} windows {worst:.3g}")
    assert worst <= TOL
    ranks = max(rel_l2(run.grads[1][w], run.grads[0][w]) for w in range(len(run.windows)))
    assert ranks <= 1e-12


def test_first_optimizer_step_gradient_accumulation_2(runs: dict[str, Any]) -> None:
    run = runs["accum2"]
    assert len(run.windows[0]) == 2
    err = run.error(0)
    errors = [run.error(w) for w in range(len(run.windows))]
    print(f"[accum2] window 0 rel L2 {err:.3g}; max over {len(errors)} windows {max(errors):.3g}")
    assert err <= TOL and max(errors) <= TOL
    # Without lightning_loss, Lightning's `/ accumulate_grad_batches` halves it.
    ref = run.ref.mean(run.ids(run.windows[0]))
    wrong = rel_l2(run.grads[0][0] / 2, ref)
    assert wrong > WRONG


def test_lora_gradient_accumulation_2(runs: dict[str, Any]) -> None:
    """PEFT LoRA, G=2, uneven packed shards: the gradient is on the adapter weights
    only and every window's is the per-token mean's; halved (no lightning_loss) or
    each rank's plain mean (no loader scale), it is not."""
    run = runs["accum2_lora"]
    adapter = torch.cat(
        [torch.full((p.numel(),), "lora_" in n) for n, p in run.ref.model.named_parameters()]
    )
    for grad in run.grads[0]:
        assert (grad[~adapter] == 0).all() and (grad[adapter] != 0).any()
    errors = [run.error(w) for w in range(len(run.windows))]
    ref = run.ref.mean(run.ids(run.windows[0]))
    halved = rel_l2(run.grads[0][0] / 2, ref)
    unscaled = max(
        rel_l2(run.unscaled_local_mean(w), run.ref.mean(run.ids(run.windows[w])))
        for w in range(len(run.windows))
    )
    print(
        f"[accum2_lora] max rel L2 over {len(errors)} windows {max(errors):.3g}; "
        f"halved {halved:.3g}, unscaled {unscaled:.3g}"
    )
    assert max(errors) <= TOL < WRONG < min(halved, unscaled)


def test_gradient_at_a_pad_step(runs: dict[str, Any]) -> None:
    run = runs["accum2"]
    pads = [
        w
        for w, ts in enumerate(run.windows)
        if any(run.steps[1][t]["is_pad"] and not run.steps[0][t]["is_pad"] for t in ts)
    ]
    assert pads, "rank 1 never padded: the shards are not uneven enough"
    w = pads[0]
    err = run.error(w)
    ref = run.ref.mean(run.ids(run.windows[w]))
    wrong = rel_l2(run.unscaled_local_mean(w), ref)
    print(f"[accum2] pad window {w} rel L2 {err:.3g} (unscaled local mean {wrong:.3g})")
    assert err <= TOL < WRONG < wrong


def test_manual_optimization_tokens_per_update(runs: dict[str, Any]) -> None:
    run = runs["manual"]
    lengths = {len(w) for w in run.windows}
    assert len(run.windows) >= 3 and max(lengths) > 1 and len(lengths) > 1, run.windows
    errors = [run.error(w) for w in range(len(run.windows))]
    print(f"[manual] max rel L2 over {len(errors)} token windows {max(errors):.3g}")
    assert max(errors) <= TOL
    assert any(row["is_pad"] for row in run.steps[1])


# ---- checkpoint and resume ----------------------------------------------------------------------


def test_mid_epoch_checkpoint_resume_is_exactly_once(runs: dict[str, Any]) -> None:
    first, second = runs["resume"]["first"], runs["resume"]["second"]
    n = len(first.dataset)
    trained_first = first.ids(list(range(len(first.steps[0]))))
    trained_second = second.ids(list(range(len(second.steps[0]))))
    assert first.raw[0]["global_step"] == RESUME_AT
    assert 0 < len(trained_first) < n, "the checkpoint should be mid-epoch"
    assert sorted(trained_first + trained_second) == list(range(n)), "resume not exactly once"
    # the resumed run continues the step numbering and the windows
    assert second.steps[0][0]["step"] == len(first.steps[0])
    assert second.raw[0]["global_step"] == RESUME_AT + len(second.windows)
    errors = [second.error(w) for w in range(len(second.windows))]
    print(f"[resume] max rel L2 over {len(errors)} resumed windows {max(errors):.3g}")
    assert max(errors) <= TOL
    # the state a checkpoint would hold was rebuilt and checked after every batch
    for name, run in _all_runs(runs):
        assert run.raw[0]["checked_states"] == len(run.steps[0]), name
    # A naive checkpoint (the loader's own state at save time) counts the batch
    # Lightning had prefetched but not trained as done: resuming from it loses it.
    for r in range(WORLD):
        naive = set(first.raw[r]["naive_done"])
        trained = set(first.ids(list(range(len(first.steps[r]))), r))
        assert trained < naive, "the prefetched batch should be in the naive state"


def test_checkpoint_at_epoch_end_resumes_into_the_next_epoch(runs: dict[str, Any]) -> None:
    first, second = runs["resume_end"]["first"], runs["resume_end"]["second"]
    n = len(first.dataset)
    assert {row["epoch"] for row in first.steps[0]} == {0}
    assert {row["epoch"] for row in second.steps[0]} == {1}
    assert second.steps[0][0]["step"] == 0
    every = list(range(len(second.steps[0])))
    assert sorted(first.ids(list(range(len(first.steps[0]))))) == list(range(n))
    assert sorted(second.ids(every)) == list(range(n)), "epoch 1 after resume not exactly once"
    assert second.ids(every, 0) != first.ids(list(range(len(first.steps[0]))), 0)
    assert second.raw[0]["global_step"] == first.raw[0]["global_step"] + len(second.windows)
    assert max(second.error(w) for w in range(len(second.windows))) <= TOL


# ---- the runnable example ------------------------------------------------------------------


def test_lightning_sft_example_runs(tmp_path: Path) -> None:
    """`python examples/lightning_sft.py` (Lightning starts its 2 ranks), small: every
    sample once per epoch, windows of 2 steps with the last one stepped, the loss falls."""
    example = Path(__file__).resolve().parents[1] / "examples" / "lightning_sft.py"
    cmd = [sys.executable, str(example), "--samples", "120", "--epochs", "2"]
    cmd += ["--out", str(tmp_path / "run")]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    proc = run_script(cmd, tmp_path, env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = (
        r"epoch (\d): (\d+) aligned steps, (\d+) optimizer updates, (\d+) samples, "
        r"mean loss ([\d.]+)"
    )
    epochs = [tuple(float(x) for x in m) for m in re.findall(line, proc.stdout)]
    assert [(e[0], e[3]) for e in epochs] == [(0, 120), (1, 120)], out
    for _, steps, updates, _, _ in epochs:
        assert updates == -(-steps // 2), out
    assert epochs[1][4] < epochs[0][4], out
    done = re.search(r"done on 2 ranks: (\d+) optimizer steps \(estimated (\d+)\)", proc.stdout)
    assert done, out
    assert 0 < int(done[1]) <= int(done[2])


# ---- bad input (one process, no process group) ---------------------------------------------


def test_bad_input() -> None:
    ds = ChatSFT(8)
    with pytest.raises(ConfigError, match="DataLoader"):
        ODBDataModule(DataLoader(ds), token_budget=256)
    with pytest.raises(ConfigError, match="drop_last"):
        ODBDataModule(ds, token_budget=256, drop_last=True)
    with pytest.raises(ConfigError, match="token_budget"):
        ODBDataModule(ds)
    with pytest.raises(ConfigError, match="unknown"):
        ODBDataModule(ds, token_budget=256, tokenbudget=3)
    with pytest.warns(UserWarning, match="batch_size=8.*ignored"):
        ODBDataModule(ds, token_budget=256, batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ODBDataModule(ds, token_budget=256, batch_size=8)  # said once
    assert check_lightning_version()
    with pytest.warns(UserWarning, match="outside the range.*odb-core\\[lightning\\]"):
        assert not check_lightning_version("2.1.0")


def test_windows_follow_accumulate_grad_batches() -> None:
    from types import SimpleNamespace

    def trainer(accumulate: int, automatic: bool = True) -> Any:
        return SimpleNamespace(
            accumulate_grad_batches=accumulate,
            lightning_module=SimpleNamespace(automatic_optimization=automatic),
            strategy=SimpleNamespace(handles_gradient_accumulation=False),
        )

    assert ODBDataModule._windows(trainer(2), {})["grad_accum_steps"] == 2
    assert ODBDataModule._windows(trainer(1), {})["grad_accum_steps"] is None
    assert ODBDataModule._windows(trainer(3), {"grad_accum_steps": 3})["grad_accum_steps"] == 3
    with pytest.raises(ConfigError, match="accumulate_grad_batches=4"):
        ODBDataModule._windows(trainer(2), {"grad_accum_steps": 4})
    with pytest.raises(ConfigError, match="manual optimization"):
        ODBDataModule._windows(trainer(1), {"tokens_per_update": 512})
    manual = ODBDataModule._windows(trainer(1, automatic=False), {"tokens_per_update": 512})
    assert manual == {"tokens_per_update": 512}


def test_the_old_trainer_name_is_a_deprecated_alias() -> None:
    with pytest.warns(DeprecationWarning, match="use ODBLightningTrainer"):
        assert odb_pl.ODBTrainer is ODBLightningTrainer
