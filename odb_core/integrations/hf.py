"""HF Trainer adapter: `ODBHFTrainer`, a `transformers.Trainer` whose train dataloader
is an `ODBDataLoader` built from `train_dataset` and `data_collator`.

    trainer = ODBHFTrainer(
        model=model,
        args=TrainingArguments(output_dir="out", num_train_epochs=3,
                               gradient_accumulation_steps=4),
        train_dataset=dataset,            # processed samples (a map-style dataset)
        data_collator=collate,            # pads or packs a list of samples
        odb=ODBArguments(token_budget=16384),   # or odb=dict(token_budget=16384, ...)
    )
    trainer.train()                       # or trainer.train(resume_from_checkpoint=True)

What transformers 5.24's Trainer does (its loop sized from `len(train_dataloader)`,
G micro-batches per optimizer step, its own loss normalisation) and what the adapter
overrides about it, patching nothing: docs/TRAINERS.md, "Hugging Face Trainer". A
short window reaches `get_batch_samples` preceded by empty fill entries
(`_WindowFill`) that `training_step` skips; `compute_loss` normalises by the window's
loss tokens (`meta.loss_denominator`). Beside it, one job each: `hf_args`
(`ODBArguments`, the checks of the Trainer's arguments), `hf_plan` (the loop's sizes
and the run's plan), `hf_lr` (the schedule), `hf_callback` (the Trainer's view of
the plan, a save at each checkpoint), `hf_checkpoint` (what a checkpoint folder holds:
every rank's loader state, so no `skip_first_batches`); the members that are not
public API: `PRIVATE_MEMBERS`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from odb_core.config import LossNormalization
from odb_core.errors import ConfigError, ODBError
from odb_core.integrations import versions
from odb_core.integrations.hf_args import (
    ODBArguments,
    check_training_args,
    run_options,
    whole_epochs,
)
from odb_core.integrations.hf_callback import RunCallback
from odb_core.integrations.hf_checkpoint import resume_folder, write_folder
from odb_core.integrations.hf_lr import ClampedLR, progress_lr
from odb_core.integrations.hf_plan import loop_sizes, warn_resized
from odb_core.integrations.versions import deprecated_names
from odb_core.progress import RunProgress
from odb_core.torch import ODBDataLoader
from odb_core.torch.adapter_options import check_dataset
from odb_core.torch.checkpoint import gather_states
from odb_core.torch.meta import STEP_META_KEY, pop_step_meta, scaled_loss, zero_if_unweighted
from odb_core.torch.plan import RunFigures, RunPlan
from odb_core.torch.trainer_checks import find_unused_for_vision
from odb_core.torch.window_batches import next_window

__all__ = [
    "PRIVATE_MEMBERS",
    "SUPPORTED_TRANSFORMERS",
    "ClampedLR",
    "ODBArguments",
    "ODBHFTrainer",
    "check_transformers_version",
]

#: The transformers versions this adapter is tested with when odb-core's metadata
#: names no `[hf]` range (`versions.GATES`).
SUPPORTED_TRANSFORMERS = versions.GATES["transformers"].fallback

_warned: set[str] = set()


#: Trainer members that are not public API it relies on (`versions.PRIVATE_MEMBERS`).
PRIVATE_MEMBERS = versions.PRIVATE_MEMBERS["transformers"]


def check_transformers_version(version: str | None = None) -> bool:
    """Warn once when `transformers.__version__` is outside the supported range;
    raise `ConfigError` when the Trainer lacks a member the adapter relies on."""
    return versions.gate("transformers", version, warned=_warned)


# ---- what the Trainer's loop iterates ----------------------------------------------------


class _TrainBatches:
    """What the Trainer iterates: one pass is the rest of the loader's current epoch
    (the loader starts its next epoch itself), none once the run's `epochs` are
    done. No `set_epoch` (the Trainer's counter restarts at 0 on resume), no
    `batch_sampler`."""

    def __init__(self, loader: ODBDataLoader, epochs: int | None) -> None:
        self.loader, self.epochs = loader, epochs

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        epochs = self.epochs
        if epochs is not None and self.loader.run_progress.epochs_done >= epochs:
            return iter(())
        return iter(self.loader)


class _WindowFill(dict):  # type: ignore[type-arg]
    """An empty entry before a short window's batches (see the module docstring)."""


# ---- the trainer -------------------------------------------------------------------------


class ODBHFTrainer(Trainer):
    """A `transformers.Trainer` whose train dataloader is an `ODBDataLoader`.

    `odb`: `ODBArguments` (or a dict of them / of ODBDataLoader options). Everything
    else is the Trainer's. `num_train_epochs=E` runs exactly E loader epochs, each
    sample once per epoch; `gradient_accumulation_steps=G` windows are the loader's;
    the loss is normalised over each window's real tokens on every rank;
    checkpoints carry the loader's position. `per_device_train_batch_size` is
    ignored (the token budget sizes batches). Evaluation is the Trainer's own.

    After each `get_batch_samples`, `odb_window_info` lists the `StepInfo` of the
    window's batches (sample ids, counts, pad flags); `odb_loader` is the loader.
    """

    loss_is_scaled_for_ga = True  # the core's scale already covers the whole window
    _odb_adapter = True  # the loader's check for a plain Trainer (odb_core.torch.trainer_checks)

    def __init__(self, *args: Any, odb: ODBArguments | Mapping[str, Any], **kwargs: Any) -> None:
        check_transformers_version()
        self.odb_args = ODBArguments.coerce(odb)
        self.odb_args.loader_options(_warned)  # owned keys fail here, not at train()
        find_unused_for_vision(
            kwargs.get("model", args[0] if args else None),
            kwargs.get("args", args[1] if len(args) > 1 else None),
        )
        super().__init__(*args, **kwargs)
        self.odb_loader: ODBDataLoader | None = None
        self.odb_window_info: list[Any] = []
        self._odb_batches: _TrainBatches | None = None
        self._odb_resume_dir: str | None = None
        self._odb_saved: RunPlan | None = None  # the run's plan a resumed checkpoint holds
        self._odb_schedule_steps: int | None = None
        self._odb_planned_updates: int | None = None  # state.max_steps, the planned total
        self._odb_warmup_base: int | None = None  # what warmup_steps are a fraction of
        self._odb_figures: RunFigures | None = None  # the figures of the run's plan
        self._odb_target_epochs: int | None = None
        deepspeed = getattr(self, "is_deepspeed_enabled", False)
        check_training_args(self.args, self.odb_args, deepspeed, _warned)
        run_options(self.odb_args, self.args, self.train_dataset, self.model, _warned)  # checks
        self._check_train_dataset(self.train_dataset)
        # First in line: its on_step_end keeps state.max_steps ahead of global_step, or
        # at it on the run's last step, before DefaultFlowCallback reads it.
        self.callback_handler.callbacks.insert(0, RunCallback(self))

    # ---- checks --------------------------------------------------------------------------

    @staticmethod
    def _check_train_dataset(dataset: Any) -> None:
        check_dataset(
            "ODBHFTrainer",
            "train_dataset",
            dataset,
            "Pass the dataset itself (train_dataset=loader.dataset) and the loader options "
            "as odb=ODBArguments(...)",
        )

    # ---- the train dataloader ------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        """Build the `ODBDataLoader` (the process group exists by now) and, when
        resuming, load its state from the checkpoint folder."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        self._check_train_dataset(self.train_dataset)
        self.close_odb_loader()
        args = self.args
        loader = ODBDataLoader(
            self.train_dataset,
            collate_fn=self._get_collator_with_removed_columns(self.data_collator, "training"),
            **run_options(self.odb_args, args, self.train_dataset, self.model, _warned),
        )
        self.odb_loader = loader
        by_epochs = args.max_steps <= 0
        self._odb_target_epochs = whole_epochs(args.num_train_epochs) if by_epochs else None
        self._odb_batches = _TrainBatches(loader, self._odb_target_epochs)
        self._odb_saved, self._odb_figures = None, None
        if self._odb_resume_dir is not None:
            self._load_odb_state(self._odb_resume_dir)
        return self._odb_batches

    def close_odb_loader(self) -> None:
        """Stop the loader's background protocol thread (a `train()` that stopped
        mid-epoch leaves it waiting); `odb_loader` stays readable."""
        if self.odb_loader is not None:
            self.odb_loader.close()

    def set_initial_training_values(
        self, args: TrainingArguments, dataloader: Any
    ) -> tuple[int, int, int, int, int, int, int]:
        """The loop's sizes: a per-epoch cap no epoch reaches, the epoch count, and
        (kept for the scheduler and the progress bar) the estimated optimizer steps."""
        batches = self._odb_batches
        if dataloader is not batches or batches is None:
            raise ConfigError(
                "ODBHFTrainer's train dataloader must be the one its get_train_dataloader "
                f"builds (an ODBDataLoader); got {type(dataloader).__name__}. Do not override "
                "get_train_dataloader; pass the dataset and odb=ODBArguments(...) instead"
            )
        run = loop_sizes(args, batches.loader, batches.epochs, self._odb_saved)
        self._odb_schedule_steps, self._odb_planned_updates = run.schedule_steps, run.planned
        if run.figures is not None:  # a run of epochs: the figures of its plan
            self._odb_warmup_base, self._odb_figures = run.figures.warmup_base, run.figures
        return run.sizes

    @property
    def run_progress(self) -> RunProgress:
        """The loader's run progress (the Trainer fetches a whole window and trains it
        before the next, so the loader's last batch is the one in training)."""
        if self.odb_loader is None:
            raise ODBError("run_progress before get_train_dataloader built the loader")
        return self.odb_loader.run_progress

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """`lr_scheduler_type` on the run's exact progress (`ProgressLR`) when the run is
        a number of epochs and the type has a progress form (hf_lr.py); otherwise the
        Trainer's schedule, sized to the estimated optimizer steps and clamped."""
        epochs = self._odb_target_epochs
        if self.lr_scheduler is None and epochs is not None:
            self.lr_scheduler = progress_lr(
                self.args,
                optimizer or self.optimizer,
                self,
                epochs=epochs,
                planned_updates=max(1, self._odb_warmup_base or num_training_steps),
                tokens=self.odb_args.lr_tokens,
            )
            if self.lr_scheduler is not None:
                return self.lr_scheduler
        created = self.lr_scheduler is None
        steps = self._odb_schedule_steps or num_training_steps
        scheduler = super().create_scheduler(steps, optimizer)
        if created:
            self.lr_scheduler = ClampedLR.around(scheduler, steps)
            self._warn_resized()
        return self.lr_scheduler

    def _warn_resized(self) -> None:
        """A step-sized schedule of a run a resume replanned changes length there."""
        if self.odb_loader is not None:
            warn_resized(
                _warned,
                self._odb_figures,
                scheduler_type=self.args.lr_scheduler_type,
                world_size=self.odb_loader.world_size,
                epochs=self._odb_target_epochs,
            )

    # ---- one window at a time ------------------------------------------------------------

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: Any
    ) -> tuple[list[Any], Any]:
        """One optimizer window of the loader's (not `num_batches` batches), short-window
        fill in front; at the epoch's end, nothing, and the epoch stops."""
        loader = self.odb_loader
        if loader is None:
            raise ODBError("get_batch_samples before get_train_dataloader built the loader")
        window, self.odb_window_info = next_window(epoch_iterator, loader)
        if not window:
            self._epoch_ended(loader.run_progress)
            return [], None
        accum = self.args.gradient_accumulation_steps
        if len(window) > accum:
            raise ODBError(
                f"the loader's window has {len(window)} steps, more than "
                f"gradient_accumulation_steps={accum}"
            )
        main = getattr(self.model, "main_input_name", "input_ids")
        fill = [
            _WindowFill({main: torch.zeros(0, dtype=torch.long)})
            for _ in range(accum - len(window))
        ]
        return fill + window, None

    def _epoch_ended(self, progress: RunProgress) -> None:
        state = self.state
        state.epoch = progress.epochs_run
        self.control.should_epoch_stop = True
        target = self._odb_target_epochs
        if target is not None and progress.epochs_done >= target:  # none left (a resume)
            self.control.should_training_stop = True
            state.max_steps = state.global_step

    # ---- loss ----------------------------------------------------------------------------

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        if isinstance(inputs, _WindowFill):
            return torch.zeros((), device=self.args.device)
        out: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        return out

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The window-normalised loss of this rank's batch (see the module docstring);
        a batch without ODB metadata (evaluation) gets the Trainer's own loss."""
        if STEP_META_KEY not in inputs:
            if model.training:
                raise ODBError(
                    f"ODBHFTrainer.compute_loss got a training batch without {STEP_META_KEY!r}: "
                    "it must come from the ODBDataLoader that ODBHFTrainer builds"
                )
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        meta = pop_step_meta(inputs)
        by_tokens = meta.loss_normalization is LossNormalization.TOKENS
        sums = self.loss_takes_num_items()
        if by_tokens and (sums or self.label_smoother is not None):
            # Σ token loss / num_items, num_items = window tokens / W, times the factor
            # the Trainer multiplies by afterwards (average_tokens_across_devices).
            items = meta.loss_denominator * self._hf_loss_factor(sums)
            n = torch.tensor(items, dtype=torch.float64, device=self.args.device)
            result = super().compute_loss(model, inputs, return_outputs, n)
            loss: torch.Tensor = cast(Any, result)[0] if return_outputs else cast(Any, result)
            loss = zero_if_unweighted(meta, loss)  # a pad batch holds a real sample: weight 0
        else:
            result = super().compute_loss(model, inputs, return_outputs, None)
            loss = cast(Any, result)[0] if return_outputs else cast(Any, result)
            loss = scaled_loss(meta, loss)  # this rank's mean x W x local / window; 0 on a pad
        return (loss, cast(Any, result)[1]) if return_outputs else loss

    def loss_takes_num_items(self) -> bool:
        """Whether the parent's `compute_loss` divides a summed token loss by its
        `num_items_in_batch` (the model's own loss with loss kwargs, or a
        `compute_loss_func`); otherwise it returns a mean, which the core's scale
        rescales. A trainer subclass with its own loss overrides this."""
        return bool(self.model_accepts_loss_kwargs or self.compute_loss_func is not None)

    def _hf_loss_factor(self, sums: bool) -> float:
        """What Trainer.compute_loss multiplies a num_items-normalised loss by."""
        if not (self.args.average_tokens_across_devices and sums):
            return 1.0
        return float(self.accelerator.num_processes // self.get_tp_size())

    # ---- checkpoints ---------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """`Trainer.train`; a resumed run continues the loader from the checkpoint."""
        checkpoint: Any = resume_from_checkpoint
        if checkpoint is True:
            found = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call]
            checkpoint = found if found is not None else True  # the Trainer raises
        self._odb_resume_dir = (
            os.fspath(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else None
        )
        skip = self.args.ignore_data_skip
        self.args.ignore_data_skip = True  # no skip_first_batches: the loader state resumes
        try:
            return super().train(
                resume_from_checkpoint=checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
            )
        finally:
            self.args.ignore_data_skip = skip
            self._odb_resume_dir = None

    def save_odb_state(self, folder: str | os.PathLike[str]) -> None:
        """Write every rank's loader state (`odb_core.torch.checkpoint`, the format of
        every adapter) and the schedule length into a checkpoint folder: a collective,
        call it on every rank (the callback does at each save); rank 0 writes."""
        loader = self.odb_loader
        if loader is None:
            return
        states = gather_states(loader)
        if not self.args.should_save:
            return
        plan = RunPlan(
            world_size=loader.world_size,
            epochs=self._odb_target_epochs,
            max_steps=self.args.max_steps,
            updates=self.state.global_step,
            total=self._odb_schedule_steps,
            planned=self._odb_planned_updates,
            warmup_base=self._odb_warmup_base,
        )
        write_folder(folder, states, plan)

    def _load_odb_state(self, folder: str) -> None:
        self._odb_saved = resume_folder(folder, cast(ODBDataLoader, self.odb_loader))


__getattr__ = deprecated_names(__name__, {"ODBTrainer": ("ODBHFTrainer", ODBHFTrainer)})
