"""Lightning: where the learning-rate schedule ends after a resume at another world size.

Real gloo ranks (`gloo_ranks.launch`), CPU, a tiny model, SGD at a real rate. A
2-rank fit of `max_epochs=2` (accumulate_grad_batches=2) under each schedule
kind, uninterrupted and stopped at a checkpoint inside epoch 0 (after 2 of its 4
updates), resumed on 1 and on 2 ranks:

- `lambda`: the common user pattern, a linear `LambdaLR` to 0 sized from
  `trainer.estimated_stepping_batches` in `configure_optimizers`;
- `progress`: `ProgressLR` (linear to 0), driven by the run's exact progress.

Each rank records the rate every optimizer update used, the updates run, the
estimate `configure_optimizers` saw, the rate after the last update, and odb's
warnings. What is guaranteed:

- `ProgressLR` ends at its final value exactly on the last update, uninterrupted
  and after a resume at either world size, and continues from the checkpoint's rate;
- at the same world size, a resume keeps the run's `estimated_stepping_batches`
  (saved in the checkpoint): the `LambdaLR` run is the uninterrupted one;
- at another world size, `estimated_stepping_batches` is the updates done + the
  loader's upper estimate of the updates left there (`plan.updates_left`, checked
  against a one-rank loader resumed from the checkpoint), with a warning naming
  the figures: a schedule sized from it does not end before the run; its total
  fixed when built, it changes length at the resume and, an estimate, ends near,
  not on, the last update (as in an uninterrupted run).

Uninterrupted, the run ends short of `estimated_stepping_batches` (an upper
estimate), so the `LambdaLR` stops above 0: the adapter warns once at the end of
the run, naming the updates, the estimate, the rate and `ProgressLR`; never for a
`ProgressLR` run or a stopped one. Switched off ("lambda/unwarned"), it is caught.

Broken variants, each caught: the old recompute (max_epochs x an epoch's upper
estimate at the new world size, as if the run started there) and a replan at the
same world size (which drops the run's figure).
"""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from gloo_ranks import launch, ok  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from sft_support import VOCAB, ChatSFT, pad_collate  # noqa: E402

from odb_core.bench.launch import free_port  # noqa: E402
from odb_core.integrations import lightning as odb_pl  # noqa: E402
from odb_core.integrations import lightning_plan as odb_plan  # noqa: E402
from odb_core.integrations.lightning import (  # noqa: E402
    ODBDataModule,
    ODBLightningTrainer,
    lightning_loss,
)
from odb_core.torch import ProgressLR, pop_step_meta, scaled_loss  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.procs, pytest.mark.slow]  # gloo ranks

PEAK = 1e-2
EPOCHS = 2
STOP_AT = 2  # optimizer updates before the checkpoint (inside epoch 0, of 4)
DATA = {"n": 40, "seed": 8}
LOADER = {
    "deterministic": True,
    "buffer_size": 16,
    "max_steps_per_round": 4,
    "cost_model": "padded",
    "token_budget": 160,
    "shuffle": True,
    "seed": 6,
}
KINDS = ("lambda", "progress")
KINDS_RUNS = [f"{kind}/{part}" for kind in KINDS for part in ("full", "first")]


class Tiny(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)
        self.estimate: Any = None

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        meta = pop_step_meta(batch)
        logits = self.head(self.emb(batch["input_ids"]))
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1)
        )
        return lightning_loss(self, scaled_loss(meta, loss))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=PEAK)
        if self.kind == "lambda":
            total = self.estimate = int(self.trainer.estimated_stepping_batches)
            sched: Any = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: max(0.0, (total - s) / total)
            )
        else:
            self.estimate = self.trainer.estimated_stepping_batches
            sched = ProgressLR(opt, self.trainer.datamodule, epochs=self.trainer.max_epochs)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Rates(Callback):
    def __init__(self, stop_at: int | None) -> None:
        self.lrs: list[float] = []
        self.stop_at = stop_at

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if self.stop_at is not None and trainer.global_step == self.stop_at:
            trainer.should_stop = True


def _fit(
    kind: str, root: Path, world: int, *, stop_at: int | None = None, ckpt: str | None = None
) -> dict[str, Any]:
    rates = Rates(stop_at)
    callbacks: list[Any] = [rates]
    if stop_at is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=stop_at, save_top_k=-1)
        )
    trainer = ODBLightningTrainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy=DDPStrategy(process_group_backend="gloo") if world > 1 else "auto",
        max_epochs=EPOCHS,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        enable_checkpointing=stop_at is not None,
        callbacks=callbacks,
    )
    module = Tiny(kind)
    dm = ODBDataModule(ChatSFT(**DATA), collate_fn=pad_collate, **LOADER)
    odb_pl._warned.discard("short")  # once per process: once per fit here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
    said = [str(w.message) for w in caught if "estimated_stepping_batches" in str(w.message)]
    sched = trainer.lr_scheduler_configs[0].scheduler
    out: dict[str, Any] = {
        "lrs": rates.lrs,
        "updates": trainer.global_step,
        "estimate": module.estimate,
        "final_lr": float(sched.get_last_lr()[0]),
        "warnings": [w for w in said if "the run ended after" not in w],
        "short": [w for w in said if "the run ended after" in w],
    }
    if stop_at is not None:
        (path,) = sorted((root / "ckpt").glob("*.ckpt"))
        out["ckpt"] = str(path)
    return out


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    warnings.filterwarnings("ignore", ".*does not have many workers.*")


def run_first(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """On 2 ranks: each kind uninterrupted, and stopped at a checkpoint."""
    _env(rank, world, spec["port"])
    root = Path(spec["root"])
    out: dict[str, Any] = {}
    for kind in KINDS:
        out[f"{kind}/full"] = _fit(kind, root / kind / "full", world)
        torch.distributed.barrier()
        out[f"{kind}/first"] = _fit(kind, root / kind / "first", world, stop_at=STOP_AT)
        torch.distributed.barrier()
    odb_plan.check_short_schedule = lambda *a: None  # broken: the check switched off
    out["lambda/unwarned"] = _fit("lambda", root / "lambda" / "unwarned", world)
    return out


def _old_total(dm: Any, trainer: Any, epochs: int, plan: Any) -> int:
    """Broken: the figure recomputed on resume as if the run started at this world size."""
    return int(plan.upper)


def _replan_always(dm: Any, trainer: Any, epochs: int, plan: Any) -> int:
    """Broken: done + left even at the same world size (the run's figure dropped)."""
    if dm.saved_plan is None:
        return int(plan.upper)
    dm.load_pending()
    left = odb_plan.updates_left(dm.loader, epochs)
    return int(dm.saved_plan.updates) + int(left or 0)


BROKEN = {"old": _old_total, "replan": _replan_always}


def run_resume(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Resume the checkpoint of each kind in `spec["kinds"]` on `world` ranks
    (`spec["broken"]`: a broken variant of the resumed figure)."""
    _env(rank, world, spec["port"])
    if spec.get("broken"):
        odb_plan._run_total = BROKEN[spec["broken"]]  # type: ignore[assignment]
    root = Path(spec["root"])
    out: dict[str, Any] = {}
    for kind in spec["kinds"]:
        out[kind] = _fit(kind, root / kind, world, ckpt=spec["ckpt"][kind])
        torch.distributed.barrier()
    return out


# ---- the parent's view ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("lr_first")
    spec = {"root": str(tmp), "port": free_port()}
    per_rank = ok(launch("test_lightning_lr_resume:run_first", 2, spec, tmp))
    for name in KINDS_RUNS:  # the ranks agree on every rate
        assert all(r[name]["lrs"] == per_rank[0][name]["lrs"] for r in per_rank), name
    return per_rank[0]


def _resume(
    first: dict[str, Any], world: int, tmp: Path, kinds: tuple[str, ...] = KINDS, broken: str = ""
) -> dict[str, Any]:
    spec = {
        "root": str(tmp),
        "port": free_port(),
        "kinds": list(kinds),
        "broken": broken,
        "ckpt": {kind: first[f"{kind}/first"]["ckpt"] for kind in kinds},
    }
    per_rank = ok(launch("test_lightning_lr_resume:run_resume", world, spec, tmp))
    for kind in kinds:
        assert all(r[kind]["lrs"] == per_rank[0][kind]["lrs"] for r in per_rank), kind
    return per_rank[0]


@pytest.fixture(scope="module")
def resumed(first: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    return {w: _resume(first, w, tmp_path_factory.mktemp(f"lr_resume{w}")) for w in (1, 2)}


def _report(name: str, run: dict[str, Any]) -> str:
    lrs = run["lrs"]
    return (
        f"{name}: {run['updates']} updates, estimate {run['estimate']}, "
        f"lr at the last update {lrs[-1]:.6g}, after it {run['final_lr']:.6g}"
    )


def check_same_world_size(first: dict[str, Any], resumed: dict[str, Any]) -> None:
    """A resume at the same world size is the uninterrupted run: same figure, same rates."""
    full, second = first["lambda/full"], resumed["lambda"]
    figure, run = second["estimate"], full["estimate"]
    assert figure == run, f"the resumed figure {figure} is not the run's {run}"
    assert second["updates"] == full["updates"]
    assert second["lrs"] == pytest.approx(full["lrs"][STOP_AT:], rel=1e-12)
    assert second["final_lr"] == pytest.approx(full["final_lr"], rel=1e-12)
    assert second["warnings"] == []


def _left_at_one_rank(ckpt: str) -> int:
    """The loader's own figure, independently of the adapter: a one-rank loader
    resumed from the checkpoint's merged states, asked for the updates left."""
    from odb_core import ODBDataLoader
    from odb_core.torch.checkpoint import load_states
    from odb_core.torch.plan import updates_left

    entry = torch.load(ckpt, weights_only=False)[ODBDataModule.__qualname__]
    loader = ODBDataLoader(ChatSFT(**DATA), collate_fn=pad_collate, grad_accum_steps=2, **LOADER)
    load_states(loader, entry)
    left = updates_left(loader, EPOCHS)
    assert left is not None
    return left


def check_another_world_size(first: dict[str, Any], resumed: dict[str, Any]) -> None:
    """At another world size: done + the loader's updates left there, warned."""
    before, second = first["lambda/first"], resumed["lambda"]
    done, total = before["updates"], second["estimate"]
    assert done == STOP_AT
    left = _left_at_one_rank(before["ckpt"])
    assert total == done + left, f"estimate {total}, not {done} done + {left} left"
    assert total >= second["updates"], "the schedule ends before the run does"
    (warning,) = second["warnings"]
    assert "world size 1" in warning and "world size 2" in warning, warning
    stated = f"{done} updates done + {left} left = {total}, not the run's {before['estimate']}"
    assert stated in warning and "ProgressLR" in warning, warning


def check_ends_on_the_last_update(before: dict[str, Any], second: dict[str, Any]) -> None:
    """The resumed run continues at the checkpoint's rate and its schedule is at its
    final value (0) right after its last update."""
    assert len(second["lrs"]) == second["updates"] - STOP_AT
    assert second["lrs"][0] == pytest.approx(before["final_lr"], rel=1e-12)
    assert second["final_lr"] == 0.0, f"the schedule ends at {second['final_lr']}, not 0"


def test_progress_lr_ends_on_the_last_update(
    first: dict[str, Any], resumed: dict[int, Any]
) -> None:
    full, before = first["progress/full"], first["progress/first"]
    print()
    print(_report("progress, uninterrupted on 2 ranks", full))
    assert full["final_lr"] == 0.0 and full["updates"] == len(full["lrs"])
    for world, runs in resumed.items():
        second = runs["progress"]
        print(_report(f"progress, resumed on {world} rank(s)", second))
        check_ends_on_the_last_update(before, second)
        rates = before["lrs"] + second["lrs"]
        assert all(a > b > 0 for a, b in itertools.pairwise(rates)), rates
        # the broken variant: a schedule sized from the step estimate, the same runs
        with pytest.raises(AssertionError, match="the schedule ends at"):
            check_ends_on_the_last_update(first["lambda/first"], runs["lambda"])
    assert resumed[2]["progress"]["lrs"] == pytest.approx(full["lrs"][STOP_AT:], rel=1e-12)
    assert resumed[1]["progress"]["updates"] > full["updates"]  # one rank: more, smaller updates


def test_lambda_lr_sized_from_the_estimate(first: dict[str, Any], resumed: dict[int, Any]) -> None:
    full = first["lambda/full"]
    print()
    print(_report("LambdaLR, uninterrupted on 2 ranks", full))
    # an upper estimate: the schedule ends after the run, never before it
    assert full["estimate"] >= full["updates"] == len(full["lrs"])
    for world, runs in resumed.items():
        print(_report(f"LambdaLR, resumed on {world} rank(s)", runs["lambda"]))
    check_same_world_size(first, resumed[2])
    check_another_world_size(first, resumed[1])


def check_short_schedule_warned(run: dict[str, Any]) -> None:
    """The run ended short of the estimate a LambdaLR was sized to: one warning with
    the figures and ProgressLR, and the rate it stopped at."""
    assert run["updates"] < run["estimate"], "the run reached the estimate"
    assert run["final_lr"] > 1e-6 * PEAK
    assert len(run["short"]) == 1, f"warned {len(run['short'])} times"
    (warning,) = run["short"]
    stated = (
        f"the run ended after {run['updates']} optimizer updates of the "
        f"estimated_stepping_batches={run['estimate']}"
    )
    assert stated in warning and f"lr {run['final_lr']:.2g}" in warning, warning
    assert "ProgressLR(optimizer, self.trainer.datamodule" in warning, warning


def test_a_short_run_warns_about_a_step_sized_schedule(first: dict[str, Any]) -> None:
    print()
    print(_report("LambdaLR, uninterrupted on 2 ranks", first["lambda/full"]))
    print(first["lambda/full"]["short"][0])
    check_short_schedule_warned(first["lambda/full"])
    for name in ("progress/full", "lambda/first", "progress/first"):
        assert first[name]["short"] == [], name  # ProgressLR, or stopped before its end
    with pytest.raises(AssertionError, match="warned 0 times"):
        check_short_schedule_warned(first["lambda/unwarned"])


@pytest.mark.parametrize(("world", "broken"), [(1, "old"), (2, "replan")])
def test_a_broken_resumed_figure_is_caught(
    first: dict[str, Any], world: int, broken: str, tmp_path: Path
) -> None:
    runs = _resume(first, world, tmp_path, ("lambda",), broken)
    print()
    print(_report(f"LambdaLR, resumed on {world} rank(s), broken ({broken})", runs["lambda"]))
    if world == 1:
        with pytest.raises(AssertionError, match=r"estimate \d+, not 2 done \+ \d+ left"):
            check_another_world_size(first, runs)
    else:
        with pytest.raises(AssertionError, match=r"the resumed figure \d+ is not the run's \d+"):
            check_same_world_size(first, runs)
