"""A Trainer callback that records, at every `on_pre_optimizer_step`, the optimizer
window an ODB trainer adapter (`ODBHFTrainer`, `ODBSFTTrainer`) ran on this rank:
its epoch, global step, per-step sample ids and pad flags, and the gradient DDP left.
Imported only by tests that have skipped without transformers."""

from __future__ import annotations

from typing import Any

from sft_support import flat_grad
from transformers import TrainerCallback


class WindowRecorder(TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.trainer: Any = None  # set once the trainer is built
        self.windows: list[dict[str, Any]] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        infos = self.trainer.odb_window_info
        self.windows.append(
            {
                "epoch": self.trainer.odb_loader.epoch,
                "global_step": state.global_step,
                "ids": [[int(x) for x in i.sample_ids] for i in infos],
                "pads": [bool(i.is_pad) for i in infos],
                "grad": flat_grad(kw["model"]),
            }
        )
