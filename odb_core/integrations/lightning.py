"""Lightning adapter: `ODBDataModule` (+ the `ODBCallback` it attaches), `ODBLightningTrainer`,
`ODBProgressBar` / `ODBRichProgressBar`, `lightning_loss`.

    dm = ODBDataModule(dataset, collate_fn=collate, token_budget=8192, shuffle=True)
    trainer = ODBLightningTrainer(max_epochs=3, accumulate_grad_batches=2)  # or pl.Trainer
    trainer.fit(model, datamodule=dm)

    def training_step(self, batch, batch_idx):            # in the LightningModule
        meta = pop_step_meta(batch)                       # this batch's own metadata
        loss = scaled_loss(meta, self.model(**batch).loss)
        return lightning_loss(self, loss)                 # undoes Lightning's `/ G`

What Lightning does, and what the adapter does about it (Lightning 2.6):

- Lightning stops an epoch at `len(train_dataloader)` and, when a length exists,
  stops prefetching and flags the last batch by count. An epoch's step count is
  decided online (`len(loader)` is an estimate), so Lightning gets an iterable
  with no length: it prefetches one batch, ends the epoch when the loader does,
  and knows the last batch (so the epoch's short last window is stepped).
- Because of that prefetch, `loader.step_info` describes the batch *after* the
  one in `training_step`; the metadata travels in the batch (`pop_step_meta`).
- Lightning divides what `training_step` returns by `accumulate_grad_batches`,
  also on the epoch's short last window; the loader's scale already normalises
  over the whole window, so `lightning_loss` multiplies it back.
  Lightning's windows (G batches from the epoch start, the last one at the
  epoch's end) are the loader's with `grad_accum_steps=G`: the DataModule sets it
  from the Trainer, and the callback checks every step that Lightning stepped the
  optimizer exactly where the window closed.
- Epochs: the loader advances its own epoch each time Lightning iterates it
  again (Lightning's `set_epoch` goes to a `sampler` attribute, which there is
  none of); the callback checks the loader's epoch against `trainer.current_epoch`.
- Checkpoints: Lightning writes the checkpoint from rank 0 and, under its prefetch,
  the loader has already yielded the next batch. `ODBDataModule.state_dict()`
  (saved in the checkpoint, resumed from `ckpt_path`) holds every rank's state as
  of the last batch that *started training* (`loader.state_after(step)`, gathered
  by `odb_core.torch.checkpoint`, the format of every adapter), so a resume
  covers the epoch exactly once. `trainer.save_checkpoint` must run on every
  rank, as Lightning documents.
- `trainer.estimated_stepping_batches` reads the length, so Lightning reports
  `max_steps` (-1); `ODBLightningTrainer` (or `estimated_stepping_batches(trainer)`) sizes it
  from the loader's upper estimate instead. `ODBProgressBar` shows the estimate.
- LR schedules: `ProgressLR(opt, datamodule, epochs=...)` in `configure_optimizers`
  (interval "step"); `ODBDataModule.run_progress` is the loader's progress as of
  the batch that is training, not of the one Lightning prefetched.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.strategies import Strategy
from torch.utils.data import DataLoader

from odb_core.errors import ConfigError, ODBError
from odb_core.integrations.versions import check_version, deprecated_names, warn_once
from odb_core.progress import RunProgress
from odb_core.protocol import StepInfo
from odb_core.torch import ODBDataLoader, StepMeta, step_meta
from odb_core.torch.checkpoint import gather_states, load_states, states_of

__all__ = [
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

#: Lightning versions the adapter is tested with (the `[lightning]` extra's range is
#: preferred when odb-core's metadata declares one).
SUPPORTED_LIGHTNING = ">=2.6,<2.7"
#: Lightning members the adapter relies on (all public API; checked on 2.6):
#: `check_lightning_version` raises when one is missing.
PRIVATE_MEMBERS: dict[str, str] = {}
_RELIES_ON = (
    (pl.Trainer, "estimated_stepping_batches"),
    (Strategy, "handles_gradient_accumulation"),
    (TQDMProgressBar, "total_train_batches"),
)
_LOADER_ARGS = frozenset(inspect.signature(ODBDataLoader.__init__).parameters) - {"self"}
_warned: set[str] = set()


def _datamodule_of(trainer: pl.Trainer) -> Any:
    return getattr(trainer, "datamodule", None)


def _warn_once(key: str, message: str) -> None:
    warn_once(_warned, key, message)


def check_lightning_version(version: str | None = None) -> bool:
    """Warn once when `lightning.__version__` is outside the supported range; raise
    `ConfigError` when a member the adapter relies on is missing."""
    return check_version(
        "lightning",
        lightning.__version__ if version is None else version,
        extra="lightning",
        fallback=SUPPORTED_LIGHTNING,
        missing=[f"{c.__name__}.{a}" for c, a in _RELIES_ON if not hasattr(c, a)],
        relies="Lightning's fit loop (prefetch, gradient accumulation, checkpoint hooks)",
        warned=_warned,
    )


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
    `state_dict()` holds every rank's loader state for Lightning's checkpoint.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        collate_fn: Any = None,
        batch_size: object = None,
        drop_last: bool = False,
        **loader_options: Any,
    ) -> None:
        super().__init__()
        check_lightning_version()
        if isinstance(dataset, ODBDataLoader):
            raise ConfigError(
                "ODBDataModule takes the dataset, not an ODBDataLoader: pass "
                "ODBDataModule(dataset, collate_fn=..., token_budget=..., ...); it builds the "
                "loader inside trainer.fit, once Lightning has started the process group"
            )
        if isinstance(dataset, DataLoader):
            raise ConfigError(
                "ODBDataModule was handed a torch DataLoader; it takes the dataset and "
                "forms token-budget batches itself: ODBDataModule(loader.dataset, "
                "collate_fn=loader.collate_fn, token_budget=...) (no batch_size, no sampler)"
            )
        if drop_last:
            raise ConfigError(
                "drop_last=True would drop samples; ODB emits every sample of the epoch "
                "exactly once and keeps ranks aligned with pad steps: remove drop_last"
            )
        if batch_size is not None:
            _warn_once(
                "batch_size",
                f"ODBDataModule(batch_size={batch_size!r}) is ignored: ODB sizes every batch "
                "by token_budget (cap the samples per batch with max_samples=)",
            )
        unknown = sorted(set(loader_options) - _LOADER_ARGS)
        if unknown:
            raise ConfigError(f"unknown ODBDataLoader option(s) {unknown}")
        if "token_budget" not in loader_options:
            raise ConfigError("ODBDataModule needs token_budget= (tokens per batch per rank)")
        if loader_options.get("with_step_info"):
            raise ConfigError(
                "with_step_info=True changes what the loader yields; under Lightning use "
                "meta = pop_step_meta(batch) in training_step"
            )
        if loader_options.get("step_meta") is False:
            raise ConfigError(
                "step_meta=False removes the metadata the Lightning adapter reads (Lightning "
                "prefetches a batch, so loader.step_info is one batch ahead)"
            )
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.loader_options = dict(loader_options)
        self.window_steps: int | None = None  # the loader's grad_accum_steps once built
        self._loader: ODBDataLoader | None = None
        self._train = _TrainLoader(self)
        self._pending: dict[str, Any] | None = None  # the loader states of a checkpoint
        self._reported_estimate: int | float | None = None
        self._callback = ODBCallback()
        self._reset_tracking()
        self._iterating = False

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
        return gather_states(self._loader, self._local_state())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            states_of(state_dict)  # the shape checked now; the states when loaded
            self._pending = dict(state_dict)

    # ---- the loader ----

    @property
    def loader(self) -> ODBDataLoader:
        """The `ODBDataLoader`, built on first access (inside `trainer.fit`)."""
        if self._loader is None:
            self._loader = self._build_loader()
        return self._loader

    def _build_loader(self) -> ODBDataLoader:
        options = dict(self.loader_options)
        trainer = self._trainer_or_none()
        if trainer is not None:
            options = self._windows(trainer, options)
            self._check_trainer(trainer)
            if trainer.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
                raise ConfigError(
                    "the ODB loader is built before torch.distributed is initialized; it is "
                    "built by train_dataloader() inside trainer.fit: do not call it earlier"
                )
        self.window_steps = options.get("grad_accum_steps")
        return ODBDataLoader(self.dataset, collate_fn=self.collate_fn, **options)

    @staticmethod
    def _windows(trainer: pl.Trainer, options: dict[str, Any]) -> dict[str, Any]:
        """Lightning's gradient-accumulation windows are the loader's."""
        module = trainer.lightning_module
        if module is not None and not module.automatic_optimization:
            return options  # you step on meta.sync_gradients
        accumulate = int(trainer.accumulate_grad_batches)
        if options.get("tokens_per_update") is not None:
            raise ConfigError(
                "tokens_per_update closes windows on loss tokens, which Lightning's automatic "
                "optimization (a fixed accumulate_grad_batches) cannot follow: use manual "
                "optimization (self.automatic_optimization = False; manual_backward the "
                "scaled loss and step the optimizer when meta.sync_gradients)"
            )
        if accumulate > 1 and trainer.strategy.handles_gradient_accumulation:
            raise ConfigError(
                f"{type(trainer.strategy).__name__} accumulates gradients itself, over "
                "windows that do not restart at each epoch; use accumulate_grad_batches=1 "
                "and manual optimization for ODB windows"
            )
        wanted = options.get("grad_accum_steps")
        if wanted is None:
            options["grad_accum_steps"] = accumulate if accumulate > 1 else None
        elif wanted != accumulate:
            raise ConfigError(
                f"grad_accum_steps={wanted} but Trainer(accumulate_grad_batches={accumulate}): "
                "Lightning steps the optimizer every accumulate_grad_batches batches, so "
                f"set accumulate_grad_batches={wanted} (or leave grad_accum_steps unset: the "
                "DataModule takes Lightning's)"
            )
        return options

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

    def _trainer_or_none(self) -> pl.Trainer | None:
        return self.trainer

    def _attach_callback(self) -> None:
        trainer = self._trainer_or_none()
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
        loader = self.loader
        last, trained = self._last, self._trained
        if last is None or trained == last.step:
            return loader.run_progress
        return loader.progress_after(trained)  # None: the pass's first batch is prefetched

    # ---- estimates ----

    def steps_estimate(self) -> Any:
        """The loader's `StepsEstimate` of the current (or next) epoch, or None for an
        IterableDataset (its size is unknown before it ends)."""
        try:
            return self.loader.steps_estimate()
        except TypeError:
            return None

    def optimizer_steps_estimate(self) -> int | None:
        """An upper estimate of one epoch's optimizer steps (windows), or None."""
        estimate = self.steps_estimate()
        if estimate is None:
            return None
        return self.loader.optimizer_steps(estimate.upper)

    # ---- iteration (Lightning's view) ----

    def _reset_tracking(self) -> None:
        self._last: StepInfo | None = None  # the batch last handed to Lightning
        self._trained: int | None = None  # step of the last batch that started training
        self._exhausted = False

    def _epoch(self) -> Iterator[Any]:
        loader = self.loader
        if self._pending is not None:
            entry, self._pending = self._pending, None
            load_states(loader, entry)
        elif self._iterating and not self._exhausted:
            _warn_once(
                "restart",
                f"Lightning started a new pass over the train loader before its epoch "
                f"{loader.epoch} ended (limit_train_batches, or an epoch ended early): that "
                "epoch's coverage is not exactly once",
            )
        it = iter(loader)
        self._reset_tracking()
        self._iterating = True
        for batch in it:
            self._last = loader.step_info
            yield batch
        self._exhausted = True

    def _local_state(self) -> dict[str, Any]:
        """This rank's state as of the last batch that started training (Lightning
        has prefetched one more)."""
        last, trained = self._last, self._trained
        if last is not None and trained is not None and trained < last.step - 1:
            raise ODBError(
                f"the loader yielded step {last.step} but step {trained} is training: a "
                "prefetch deeper than one batch, which the Lightning adapter does not support"
            )
        if last is None:
            return self.loader.state_dict()
        return self.loader.state_after(trained)

    def _on_batch_start(self, meta: StepMeta, trainer: pl.Trainer) -> None:
        loader = self.loader
        if loader.epoch != trainer.current_epoch:
            raise ODBError(
                f"Lightning is in epoch {trainer.current_epoch} but the ODB loader in epoch "
                f"{loader.epoch}: the train loader was iterated outside the fit loop, an "
                "epoch was cut short, or this DataModule already trained in an earlier fit "
                "(use a fresh ODBDataModule, or resume with ckpt_path=)"
            )
        last = self._last
        if last is None or meta.step not in (last.step, last.step - 1):
            raise ODBError(
                f"training step {meta.step} is not among the batches the loader just yielded "
                f"(last {None if last is None else last.step}); hand Lightning the "
                "ODBDataModule, not the loader"
            )
        self._trained = meta.step


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

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        dm = self._datamodule(trainer)
        try:
            meta = step_meta(batch)
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
        reported = dm._reported_estimate
        if reported is not None and trainer.global_step > reported:
            _warn_once(
                "estimate",
                f"the run passed estimated_stepping_batches={reported} (the loader's upper "
                "estimate was exceeded): an LR schedule sized to it has ended",
            )


# ---- estimates: the Trainer's and the progress bar's ------------------------------------


def estimated_stepping_batches(trainer: pl.Trainer) -> int | float:
    """`trainer.estimated_stepping_batches` for an `ODBDataModule`: max_epochs x an
    upper estimate of an epoch's optimizer steps (capped by max_steps). Lightning's
    own reads len(), which the ODB train loader does not have."""
    dm = _datamodule_of(trainer)
    if not isinstance(dm, ODBDataModule):
        return pl.Trainer.estimated_stepping_batches.fget(trainer)  # type: ignore[attr-defined,no-any-return]
    max_epochs, max_steps = trainer.max_epochs, trainer.max_steps
    if max_epochs is None or max_epochs == -1:
        return float("inf") if max_steps == -1 else max_steps
    per_epoch = dm.optimizer_steps_estimate()
    if per_epoch is None:
        _warn_once(
            "no-estimate",
            "an ODB loader over an IterableDataset has no step estimate: "
            "estimated_stepping_batches is max_steps, as in Lightning",
        )
        return max_steps
    total: int | float = per_epoch * max(int(max_epochs), 1)
    if max_steps != -1:
        total = min(total, max_steps)
    dm._reported_estimate = total
    return total


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
            estimate = dm.steps_estimate()
            return total if estimate is None else int(estimate.steps)
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
