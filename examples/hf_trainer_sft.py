"""SFT with the Hugging Face `Trainer` and ODB batching (2 ranks on CPU, or GPUs).

    torchrun --nproc_per_node 2 examples/hf_trainer_sft.py
    torchrun --nproc_per_node 2 examples/hf_trainer_sft.py --save-steps 5 --output-dir out
    torchrun --nproc_per_node 2 examples/hf_trainer_sft.py --output-dir out --resume

A tiny random-init `LlamaForCausalLM` learns chat samples whose prompts are
masked (-100). What changes from a `Trainer` run with a batch size:

- `ODBHFTrainer` instead of `Trainer`, and `odb=ODBArguments(token_budget=...)`:
  batches are sized by their padded token cost, formed after preprocessing; no
  `per_device_train_batch_size`, no sampler;
- nothing else: `num_train_epochs` runs whole epochs (each sample once per
  epoch), `gradient_accumulation_steps` windows are the loader's (the epoch's
  last one shorter, and stepped), the loss is normalised over each window's real
  tokens on every rank, the LR schedule (`lr_scheduler_type`) runs on the run's
  exact progress and ends on the last update, and `resume_from_checkpoint`
  continues mid-epoch from the loader's saved state.
"""

from __future__ import annotations

import argparse
import gc
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainingArguments

from odb_core.integrations.hf import ODBArguments, ODBHFTrainer

from sft_data import ChatSFT, pad_collate, tiny_llama


class EpochReport(TrainerCallback):
    """Per epoch: the loader's aligned steps, the optimizer updates and the samples
    trained on all ranks (from `trainer.odb_window_info`), and the mean loss."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.updates = self.samples = 0
        self.line = ""

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.updates += 1
        self.samples += sum(len(info.sample_ids) for info in self.trainer.odb_window_info)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        loader = self.trainer.odb_loader
        samples = torch.tensor([self.samples], dtype=torch.long)
        if dist.is_initialized():
            dist.all_reduce(samples)  # every rank calls on_epoch_end
        steps = loader.epoch_steps.get(loader.epoch, "?")
        self.line = (
            f"epoch {loader.epoch}: {steps} aligned steps, {self.updates} optimizer updates, "
            f"{int(samples)} samples"
        )
        self.updates = self.samples = 0

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if self.line and logs and "loss" in logs and state.is_world_process_zero:
            print(f"{self.line}, mean loss {logs['loss']:.3f}", flush=True)
            self.line = ""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output-dir", default="hf_trainer_sft_out")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N updates")
    parser.add_argument("--resume", action="store_true", help="from the last checkpoint")
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    training = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        logging_strategy="epoch",
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        use_cpu=not torch.cuda.is_available(),
        ddp_backend=None if torch.cuda.is_available() else "gloo",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    report = EpochReport()
    trainer = ODBHFTrainer(
        model=tiny_llama(),
        args=training,
        train_dataset=ChatSFT(args.samples),
        data_collator=pad_collate,
        odb=ODBArguments(token_budget=args.token_budget, cost_model="padded", buffer_size=64),
        callbacks=[report],
    )
    report.trainer = trainer
    out = trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.is_world_process_zero():
        estimate = trainer.odb_loader.steps_estimate()
        print(
            f"done on {training.world_size} ranks: {out.global_step} optimizer updates "
            f"(final learning rate {trainer.lr_scheduler.get_last_lr()[0]:.2e}; an epoch is "
            f"now estimated at {estimate.steps} steps, upper {estimate.upper}), mean loss "
            f"{out.training_loss:.3f}"
        )


def main() -> None:
    train(parse_args())  # TrainingArguments starts the process group under torchrun
    gc.collect()  # the Trainer and its callbacks refer to each other: free the model now
    if dist.is_initialized():
        # Tear down only once `train` has returned: while the model is alive it holds
        # the process group, and a group freed by the model is freed with the GIL held
        # while gloo's thread may wait for the GIL (pytorch#56297): a hang at exit. The
        # barrier lets gloo's thread finish the last collective.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
