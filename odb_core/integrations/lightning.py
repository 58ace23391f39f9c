"""Lightning adapter: `ODBDataModule` (+ the `ODBCallback` it attaches), `ODBLightningTrainer`,
`ODBProgressBar` / `ODBRichProgressBar`, `lightning_loss`.

    dm = ODBDataModule(dataset, collate_fn=collate, token_budget=8192, shuffle=True)
    trainer = ODBLightningTrainer(max_epochs=3, accumulate_grad_batches=2)  # or pl.Trainer
    trainer.fit(model, datamodule=dm)

    def training_step(self, batch, batch_idx):            # in the LightningModule
        meta = pop_step_meta(batch)                       # this batch's own metadata
        loss = scaled_loss(meta, self.model(**batch).loss)
        return lightning_loss(self, loss)                 # undoes Lightning's `/ G`

Why each piece is built as it is (Lightning 2.6's fit loop: one batch prefetched,
the epoch ended at `len()`, the loss divided by `accumulate_grad_batches`, rank 0
saving): docs/TRAINERS.md, "Lightning". The passes one batch ahead of training, and
the checkpoint as of the batch in training: `odb_core.torch.prefetch`. The run's
figures (`estimated_stepping_batches`, its resume, the warnings about them):
`odb_core.integrations.lightning_plan`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar

from odb_core.errors import ConfigError, ODBError
from odb_core.integrations import lightning_plan, versions
from odb_core.integrations.versions import deprecated_names, warn_once
from odb_core.progress import RunProgress
from odb_core.torch import ODBDataLoader, StepMeta, read_step_meta
from odb_core.torch.adapter_options import (
    check_dataset,
    check_options,
    check_world,
    trainer_windows,
)
from odb_core.torch.checkpoint import gather_states, load_states, states_of
from odb_core.torch.plan import RunPlan, UpdatesPlan, updates_plan
from odb_core.torch.prefetch import PrefetchedPasses

__all__ = [
    "PLAN_KEY",
    "PRIVATE_MEMBERS",
    "SUPPORTED_LIGHTNING",
    "ODBCallback",
    "ODBDataModule",
    "ODBLightningTrainer",
    "ODBProgressBar",
    "ODBRichProgressBar",
    "check_lightning_version",
    "estimated_stepping_batches",
    "lightning_loss",
]

#: Lightning versions the adapter is tested with when odb-core's metadata names no
#: `[lightning]` range (`versions.GATES`).
SUPPORTED_LIGHTNING = versions.GATES["lightning"].fallback
#: Lightning members it relies on that are not public API: none (`versions.GATES`
#: lists the public ones its gate checks).
PRIVATE_MEMBERS = versions.PRIVATE_MEMBERS["lightning"]
_warned = lightning_plan.warned  # the adapter's warn-once keys, one set
#: The key of the DataModule's checkpoint entry that holds the run's plan of updates
#: (`odb_core.torch.plan.RunPlan`; `total`: the `estimated_stepping_batches` reported).
PLAN_KEY = "lightning_plan"
#: Why the loader's windows cannot close on loss tokens here (`trainer_windows`).
_NO_TOKENS = (
    "it closes windows on loss tokens, which Lightning's automatic optimization (a fixed "
    "accumulate_grad_batches) cannot follow: use manual optimization (self."
    "automatic_optimization = False; manual_backward the scaled loss and step the optimizer "
    "when meta.sync_gradients)"
)


def _datamodule_of(trainer: pl.Trainer) -> Any:
    return getattr(trainer, "datamodule", None)


def _warn_once(key: str, message: str) -> None:
    warn_once(_warned, key, message)


def check_lightning_version(version: str | None = None) -> bool:
    """Warn once when `lightning.__version__` is outside the supported range; raise
    `ConfigError` when a member the adapter relies on is missing."""
    return versions.gate("lightning", version, warned=_warned)


# ---- the DataModule ---------------------------------------------------------------------


class _TrainLoader:
    """What Lightning iterates. No `__len__`: Lightning would end every epoch at it
    and stop prefetching (so it could not tell the last batch). No `state_dict`:
    Lightning would save rank 0's state, taken after its prefetched batch; the
    DataModule carries every rank's instead. No `sampler`: the loader advances
    its own epochs. `iter()` is lazy, so Lightning's iterability probe does not
    start an epoch."""

    def __init__(self, datamodule: ODBDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[Any]:
        return self.datamodule._epoch()

    def __repr__(self) -> str:
        return f"<ODB train loader of {type(self.datamodule).__name__}>"


class ODBDataModule(pl.LightningDataModule):
    """A LightningDataModule whose `train_dataloader()` is an `ODBDataLoader`.

    `ODBDataModule(dataset, collate_fn=..., token_budget=..., **loader_options)`:
    the options are `ODBDataLoader`'s; the loader is built on first use inside
    `trainer.fit` (after Lightning has started the process group). With
    automatic optimization and `Trainer(accumulate_grad_batches=G)`, the loader's
    `grad_accum_steps` is G (set it yourself only to the same value);
    `tokens_per_update=` needs manual optimization. Subclass it to add
    `val_dataloader()` etc. `batch_size` is ignored (with a warning), `drop_last`
    and a `DataLoader` in place of the dataset are rejected.

    `loader` is the `ODBDataLoader` (built on first access). The DataModule's
    `state_dict()` holds every rank's loader state for Lightning's checkpoint, and
    the run's plan of updates (`PLAN_KEY`: what `estimated_stepping_batches`
    reported, at which world size, and the updates done), which a resume keeps at
    the same world size and replans at another.
    """

    def __init__(self, dataset: Any, *, collate_fn: Any = None, **loader_options: Any) -> None:
        super().__init__()
        check_lightning_version()
        check_dataset(
            "ODBDataModule",
            "the dataset",
            dataset,
            "Pass ODBDataModule(loader.dataset, collate_fn=loader.collate_fn, token_budget="
            "...) (no batch_size, no sampler): it builds the loader inside trainer.fit, once "
            "Lightning has started the process group",
        )
        loader_options = check_options("ODBDataModule", loader_options, {}, _warned)
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.loader_options = dict(loader_options)
        self._loader: ODBDataLoader | None = None
        self._passes: PrefetchedPasses | None = None  # the passes Lightning iterates
        self._train = _TrainLoader(self)
        self._pending: dict[str, Any] | None = None  # the loader states of a checkpoint
        self.saved_plan: RunPlan | None = None  # the run's plan a checkpoint holds
        self.reported_estimate: int | float | None = None  # estimated_stepping_batches
        self._callback = ODBCallback()

    # ---- Lightning hooks ----

    def setup(self, stage: str) -> None:
        self._attach_callback()

    def train_dataloader(self) -> Any:
        self._attach_callback()
        self.loader  # noqa: B018  # build it now: the process group exists
        return self._train

    def state_dict(self) -> dict[str, Any]:
        """Every rank's loader state as of its last batch that started training, in
        the one checkpoint format (`odb_core.torch.checkpoint`; a collective: every
        rank must save, as `trainer.save_checkpoint` requires)."""
        if self._pending is not None:
            return dict(self._pending)
        if self._loader is None:
            return {}
        entry = gather_states(self._loader, self.passes.state())
        return {**entry, PLAN_KEY: lightning_plan.run_plan(self, self.trainer).to_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            states_of(state_dict)  # the shape checked now; the states when loaded
            self.saved_plan = RunPlan.from_dict(state_dict.get(PLAN_KEY), PLAN_KEY)
            self._pending = dict(state_dict)

    # ---- the loader ----

    @property
    def loader(self) -> ODBDataLoader:
        """The `ODBDataLoader`, built on first access (inside `trainer.fit`)."""
        if self._loader is None:
            self._loader = self._build_loader()
        return self._loader

    @property
    def window_steps(self) -> int | None:
        """The loader's `grad_accum_steps` (None before it is built)."""
        return None if self._loader is None else self._loader.config.grad_accum_steps

    @property
    def passes(self) -> PrefetchedPasses:
        """The loader's passes as Lightning iterates them, one batch ahead of training."""
        if self._passes is None:
            hint = "; hand Lightning the ODBDataModule, not the loader"
            self._passes = PrefetchedPasses(self.loader, depth=1, hint=hint)
        return self._passes

    def _build_loader(self) -> ODBDataLoader:
        options = dict(self.loader_options)
        trainer = self.trainer
        if trainer is not None:
            options = self._windows(trainer, options)
            self._check_trainer(trainer)
        loader = ODBDataLoader(self.dataset, collate_fn=self.collate_fn, **options)
        if trainer is not None:
            fix = "it is built by train_dataloader() inside trainer.fit: do not call it earlier"
            check_world(loader, trainer.world_size, "the Trainer", fix)
        return loader

    @staticmethod
    def _windows(trainer: pl.Trainer, options: dict[str, Any]) -> dict[str, Any]:
        """Lightning's gradient-accumulation windows are the loader's (automatic
        optimization; in manual optimization you step on meta.sync_gradients)."""
        module = trainer.lightning_module
        if module is not None and not module.automatic_optimization:
            return options
        accumulate = int(trainer.accumulate_grad_batches)
        if accumulate > 1 and trainer.strategy.handles_gradient_accumulation:
            raise ConfigError(
                f"{type(trainer.strategy).__name__} accumulates gradients itself, over "
                "windows that do not restart at each epoch; use accumulate_grad_batches=1 "
                "and manual optimization for ODB windows"
            )
        return trainer_windows(options, accumulate, "Trainer(accumulate_grad_batches)", _NO_TOKENS)

    @staticmethod
    def _check_trainer(trainer: pl.Trainer) -> None:
        limit = trainer.limit_train_batches
        if not (isinstance(limit, float) and limit == 1.0):
            _warn_once(
                "limit_train_batches",
                f"limit_train_batches={limit!r} (or fast_dev_run) cuts every epoch: an ODB "
                "epoch is then not covered exactly once and the loader's epoch does not "
                "advance; for real runs leave it at 1.0",
            )

    def _attach_callback(self) -> None:
        trainer = self.trainer
        if trainer is None:
            return
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(cb, ODBCallback) for cb in callbacks):
            callbacks.append(self._callback)

    # ---- progress ----

    @property
    def run_progress(self) -> RunProgress:
        """The loader's run progress as of the batch that is training (Lightning has
        prefetched the next one), the clock of `ProgressLR(optimizer, datamodule,
        epochs=...)`: read in `configure_optimizers` via `self.trainer.datamodule`."""
        return self.passes.progress()

    def updates_plan(self, epochs: int = 1) -> UpdatesPlan | None:
        """The loader's plan of `epochs` epochs (`odb_core.torch.plan`): its step
        estimate and updates; None for an IterableDataset (no estimate)."""
        return updates_plan(self.loader, epochs)

    # ---- iteration (Lightning's view) ----

    def load_pending(self) -> None:
        """Resume the loader from the checkpoint's states now (Lightning restores the
        DataModule before `configure_optimizers`; the loader's position then sizes
        the rest of the run). Done at the first iteration otherwise."""
        if self._pending is not None:
            entry, self._pending = self._pending, None
            load_states(self.loader, entry)

    def _epoch(self) -> Iterator[Any]:
        loader, passes = self.loader, self.passes
        if self._pending is not None:
            self.load_pending()
        elif passes.started and not passes.ended:
            _warn_once(
                "restart",
                f"Lightning started a new pass over the train loader before its epoch "
                f"{loader.epoch} ended (limit_train_batches, or an epoch ended early): that "
                "epoch's coverage is not exactly once",
            )
        yield from passes

    def _on_batch_start(self, meta: StepMeta, trainer: pl.Trainer) -> None:
        loader = self.loader
        if loader.epoch != trainer.current_epoch:
            raise ODBError(
                f"Lightning is in epoch {trainer.current_epoch} but the ODB loader in epoch "
                f"{loader.epoch}: the train loader was iterated outside the fit loop, an "
                "epoch was cut short, or this DataModule already trained in an earlier fit "
                "(use a fresh ODBDataModule, or resume with ckpt_path=)"
            )
        self.passes.start(meta.step)


# ---- the callback -----------------------------------------------------------------------


class ODBCallback(Callback):
    """Attached by `ODBDataModule` (or pass it yourself): records which batch is
    training (for the checkpoint state), checks the loader's epoch, and checks that
    Lightning steps the optimizer exactly where the loader's window closes."""

    def __init__(self) -> None:
        self._global_step = 0
        self._sync = False
        self._step = -1

    @staticmethod
    def _datamodule(trainer: pl.Trainer) -> ODBDataModule:
        dm = _datamodule_of(trainer)
        if not isinstance(dm, ODBDataModule):
            raise ConfigError(
                "ODBCallback goes with ODBDataModule: trainer.fit(model, "
                "datamodule=ODBDataModule(dataset, token_budget=..., ...))"
            )
        return dm

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = trainer.train_dataloader
        if isinstance(loaders, Mapping):
            loaders = list(loaders.values())
        if not isinstance(loaders, (list, tuple)):
            loaders = [loaders]
        if any(isinstance(dl, ODBDataLoader) for dl in loaders):
            raise ConfigError(
                "Lightning was handed an ODBDataLoader directly: it would end each epoch at "
                "len() (an estimate) and save only rank 0's state; use "
                "trainer.fit(model, datamodule=ODBDataModule(dataset, ...))"
            )
        self._datamodule(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Stop the loader's protocol thread now, on every rank, not at interpreter
        # exit, where it could still be inside a collective of a group being freed.
        dm = _datamodule_of(trainer)
        if isinstance(dm, ODBDataModule) and dm._loader is not None:
            dm._loader.close()
        if isinstance(dm, ODBDataModule):
            lightning_plan.check_short_schedule(dm, trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        dm = self._datamodule(trainer)
        try:
            meta = read_step_meta(batch)
        except (ODBError, TypeError) as exc:
            raise ConfigError(
                f"the training batch carries no ODB step metadata ({exc}): keep "
                "step_meta=True, and pop it in training_step, not before (e.g. not in "
                "on_before_batch_transfer)"
            ) from exc
        dm._on_batch_start(meta, trainer)
        self._global_step = trainer.global_step
        self._sync = bool(meta.sync_gradients)
        self._step = meta.step

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        dm = self._datamodule(trainer)
        if pl_module.automatic_optimization:
            stepped = trainer.global_step - self._global_step
            if stepped != int(self._sync):
                raise ODBError(
                    f"at step {self._step} Lightning {'stepped' if stepped else 'did not step'}"
                    f" the optimizer but the ODB window "
                    f"{'closes' if self._sync else 'does not close'} there: keep "
                    f"Trainer(accumulate_grad_batches) equal to the loader's grad_accum_steps "
                    f"({dm.window_steps or 1}) and do not change it during the run"
                )
        lightning_plan.check_past_estimate(dm, trainer)


# ---- estimates: the Trainer's and the progress bar's ------------------------------------


def estimated_stepping_batches(trainer: pl.Trainer) -> int | float:
    """`trainer.estimated_stepping_batches` for an `ODBDataModule`: max_epochs x an
    upper estimate of an epoch's optimizer steps (capped by max_steps), kept on a
    resume (`lightning_plan.planned_stepping_batches`). Lightning's own reads len(),
    which the ODB train loader does not have."""
    dm = _datamodule_of(trainer)
    if not isinstance(dm, ODBDataModule):
        return pl.Trainer.estimated_stepping_batches.fget(trainer)  # type: ignore[attr-defined,no-any-return]
    return lightning_plan.planned_stepping_batches(dm, trainer)


class ODBLightningTrainer(pl.Trainer):
    """`lightning.pytorch.Trainer` whose `estimated_stepping_batches` comes from the
    ODB loader's upper estimate (Lightning's reads len(), which would let it cut an
    epoch). Everything else is Lightning's."""

    @property
    def estimated_stepping_batches(self) -> int | float:
        if isinstance(_datamodule_of(self), ODBDataModule):
            return estimated_stepping_batches(self)
        return super().estimated_stepping_batches


class _EstimatedTotal:
    """A progress bar whose epoch total is the loader's estimate of the epoch's
    steps (Lightning's is `num_training_batches`, `inf` here)."""

    trainer: pl.Trainer

    @property
    def total_train_batches(self) -> int | float:
        total: int | float = super().total_train_batches  # type: ignore[misc]
        dm = _datamodule_of(self.trainer)
        if total == float("inf") and isinstance(dm, ODBDataModule):
            plan = dm.updates_plan()
            return total if plan is None else int(plan.estimate.steps)
        return total


class ODBProgressBar(_EstimatedTotal, TQDMProgressBar):
    """TQDM bar whose epoch total is the loader's estimate of the epoch's steps."""


class ODBRichProgressBar(_EstimatedTotal, RichProgressBar):
    """Rich bar (Lightning's default when `rich` is installed) whose epoch total is
    the loader's estimate of the epoch's steps."""


# ---- the loss -----------------------------------------------------------------------------


def lightning_loss(module: pl.LightningModule, loss: torch.Tensor) -> torch.Tensor:
    """What `training_step` returns: the ODB-scaled loss (`scaled_loss(meta, ...)` or
    `causal_lm_loss(meta, ...)`) times `accumulate_grad_batches`, which Lightning's
    automatic optimization divides by; the ODB scale already normalises over the
    whole window (also the epoch's short last one). Unchanged in manual optimization."""
    trainer = module.trainer
    accumulate = int(trainer.accumulate_grad_batches)
    if (
        module.automatic_optimization
        and accumulate != 1
        and not trainer.strategy.handles_gradient_accumulation
    ):
        return loss * accumulate
    return loss


__getattr__ = deprecated_names(
    __name__, {"ODBTrainer": ("ODBLightningTrainer", ODBLightningTrainer)}
)
