"""The callback `ODBHFTrainer` puts first in its Trainer's callbacks: the Trainer's
view of the run's plan (`state.max_steps` and the progress bar at the planned
updates, then the real count; `state.epoch` on the loader's epochs), and the
loader's state in each checkpoint folder. The trainer is an `ODBHFTrainer`
(odb_core.integrations.hf, which imports this module)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

__all__ = ["RunCallback"]


class RunCallback(TrainerCallback):
    """Keeps `state.max_steps` (and so the progress bar) at the run's planned
    optimizer updates (raised when the run outlasts it, set to the real count at
    the end), fractional logging/eval/save steps on it, and `state.epoch` on the
    loader's epochs."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        total = self.trainer._odb_planned_updates
        if self.trainer._odb_target_epochs is None or total is None:
            return
        # The planned total (the progress bar's, which ProgressCallback builds after this).
        state.max_steps = max(total, state.global_step + 1)
        fractions = [getattr(args, f"{k}_steps", None) for k in ("logging", "eval", "save")]
        if any(f is not None and 0 < f < 1 for f in fractions):
            state.compute_steps(args, total)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        loader, target = t.odb_loader, t._odb_target_epochs
        if loader is not None:
            state.epoch = loader.run_progress.epochs_run
        if loader is not None and target is not None:
            if loader.run_progress.epochs_done >= target:
                # The window just trained closed the last epoch: this step is the run's
                # last, and DefaultFlowCallback (after this one) ends the run there, with
                # its final save and evaluation.
                state.max_steps = state.global_step
            elif state.global_step >= state.max_steps:
                # The run outlasts its planned total: the epochs, not the plan, end it.
                state.max_steps = state.global_step + 1
        for bar in self._bars():  # the bar ends full, not at the estimate
            if bar.total is not None and bar.total != state.max_steps:
                bar.total = state.max_steps
                bar.refresh()

    def _bars(self) -> list[Any]:
        """The training bars of the Trainer's ProgressCallbacks (PRIVATE_MEMBERS)."""
        callbacks = self.trainer.callback_handler.callbacks
        bars = [(getattr(cb, "training_bar", None), cb) for cb in callbacks]
        return [b for b, cb in bars if b is not None and isinstance(cb, ProgressCallback)]

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Every rank (a collective), after the Trainer saved its checkpoint folder.
        folder = Path(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.trainer.save_odb_state(folder)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.close_odb_loader()
