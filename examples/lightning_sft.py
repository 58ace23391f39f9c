"""Supervised fine-tuning with Lightning and ODB on 2 CPU ranks (DDP, gloo).

    python examples/lightning_sft.py                          # Lightning starts the 2 ranks
    torchrun --nproc_per_node 2 examples/lightning_sft.py     # or torchrun does
    python examples/lightning_sft.py --epochs 1 --ckpt-every 4 --stop-at 4 --out run
    python examples/lightning_sft.py --epochs 1 --resume run/ckpt/epoch=0-step=4.ckpt

The data and the tiny model are the SFT examples' shared ones (`sft_data.py`:
chat samples whose prompt labels are masked, long-tailed lengths). What is
Lightning-specific:

- `ODBDataModule(dataset, collate_fn=..., token_budget=..., ...)` builds the
  `ODBDataLoader` inside `trainer.fit`, once the process group is up, and takes
  `grad_accum_steps` from `Trainer(accumulate_grad_batches=G)`;
- `meta = pop_step_meta(batch)` in `training_step`: Lightning prefetches one batch,
  so `loader.step_info` already describes the next one;
- `return lightning_loss(self, loss)`: Lightning divides the returned loss by G,
  the ODB scale already covers the whole window;
- `ProgressLR(opt, self.trainer.datamodule, epochs=...)`: linear decay on the
  run's exact progress, ending on the last update; `ODBLightningTrainer` sizes
  `estimated_stepping_batches` from the loader's upper estimate (printed) and
  `ODBProgressBar` shows the epoch's estimated steps;
- checkpoints (`ModelCheckpoint`, `ckpt_path=`) carry every rank's loader state,
  so a run resumed mid-epoch sees each remaining sample exactly once.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from odb_core.integrations.lightning import (
    ODBDataModule,
    ODBLightningTrainer,
    ODBProgressBar,
    lightning_loss,
)
from odb_core.torch import ProgressLR, causal_lm_loss, pop_step_meta

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_data import ChatSFT, pad_collate, tiny_llama


class SFT(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.model = tiny_llama()
        self.lr = lr
        self.stats = torch.zeros(5, dtype=torch.float64)  # CE sum, tokens, samples, steps, updates
        self.estimate: int | float = 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        meta = pop_step_meta(batch)  # this batch's metadata; removes batch["odb_step"]
        labels = batch.pop("labels")
        # Σ token CE x W / window loss tokens: after DDP's average over the ranks,
        # the window's gradient is the per-token mean over its global samples.
        loss = causal_lm_loss(meta, self.model(**batch).logits, labels)
        ce_sum = loss.item() * meta.window_loss_tokens / meta.world_size if meta.loss_scale else 0.0
        self.stats += torch.tensor(
            [ce_sum, meta.local_loss_tokens, meta.local_samples, 1, int(meta.sync_gradients)],
            dtype=torch.float64,
        )
        return lightning_loss(self, loss)  # x accumulate_grad_batches, which Lightning divides by

    def on_train_epoch_start(self) -> None:
        self.stats.zero_()

    def on_train_epoch_end(self) -> None:
        local = self.stats.clone()
        total = self.trainer.strategy.reduce(self.stats.clone(), reduce_op="sum")
        if self.trainer.is_global_zero:
            ce, tokens, samples = total[:3].tolist()
            steps, updates = int(local[3]), int(local[4])
            print(
                f"epoch {self.current_epoch}: {steps} aligned steps, {updates} optimizer updates, "
                f"{int(samples)} samples, mean loss {ce / max(tokens, 1):.3f} over "
                f"{int(tokens)} loss tokens",
                flush=True,
            )

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        total = self.estimate = self.trainer.estimated_stepping_batches  # upper estimate, > 0
        if self.trainer.is_global_zero:
            print(f"estimated optimizer steps: {total}", flush=True)
        # Linear decay to 0 on the run's exact progress: it ends on the last update.
        sched = ProgressLR(opt, self.trainer.datamodule, epochs=self.trainer.max_epochs)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class StopAt(Callback):
    """Stop after N optimizer steps (to try a mid-epoch resume)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--accumulate", type=int, default=2, help="accumulate_grad_batches")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="lightning_sft_run")
    parser.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N updates")
    parser.add_argument("--stop-at", type=int, default=0, help="stop after N updates")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dm = ODBDataModule(
        ChatSFT(args.samples),
        collate_fn=pad_collate,
        token_budget=args.token_budget,
        cost_model="padded",
        shuffle=True,
        seed=0,
    )
    callbacks: list[Callback] = [ODBProgressBar()]
    if args.ckpt_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=Path(args.out, "ckpt"), every_n_train_steps=args.ckpt_every, save_top_k=-1
            )
        )
    if args.stop_at:
        callbacks.append(StopAt(args.stop_at))
    trainer = ODBLightningTrainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=bool(args.ckpt_every),
        enable_model_summary=False,
        default_root_dir=args.out,
        callbacks=callbacks,
    )
    model = SFT(args.lr)
    trainer.fit(model, datamodule=dm, ckpt_path=args.resume)
    if trainer.is_global_zero:
        print(
            f"done on {trainer.world_size} ranks: {trainer.global_step} optimizer steps "
            f"(estimated {model.estimate})",
            flush=True,
        )


def main() -> None:
    train(parse_args())  # Lightning starts the process group inside fit
    # Lightning leaves the group alive. Free it here, once the model is gone, and not
    # at interpreter exit, where gloo's thread may still need the GIL to free the last
    # collective's tensors (pytorch#56297). The barrier lets that collective finish.
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
