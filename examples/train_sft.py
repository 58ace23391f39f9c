"""Supervised fine-tuning (SFT) on CPU with DDP and ODBDataLoader.

    torchrun --nproc_per_node 2 examples/train_sft.py
    torchrun --nproc_per_node 2 examples/train_sft.py --packed --tokens-per-update 2048

A tiny random-init `LlamaForCausalLM` learns chat samples whose prompt labels are
masked (-100), as an SFT chat template produces. A sample's cost (its length)
and its loss tokens (labels not masked) differ, so the loss is normalised by the
loss tokens of the whole optimizer window, over every rank: the update is
exactly the per-token mean over the window's global samples, with padding or
packing, gradient accumulation, uneven ranks and pad steps alike.

What changes from a plain DDP SFT loop:
- `ODBDataLoader(..., token_budget=..., grad_accum_steps=G)` (or
  `tokens_per_update=T`) instead of a DataLoader with a batch size and a
  DistributedSampler;
- `meta = pop_step_meta(batch)`, then `causal_lm_loss(meta, logits, labels)`
  (or `scaled_loss(meta, model(**batch).loss)`);
- DDP's `no_sync()` on the window's non-closing micro-steps, and the optimizer
  steps when `meta.sync_gradients`. Every rank closes the same windows at the
  same steps, so the all-reduce lines up.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from odb_core import ODBDataLoader
from odb_core.torch import causal_lm_loss, pop_step_meta

from sft_data import ChatSFT, pack_collate, pad_collate, tiny_llama


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--packed", action="store_true", help="pack each batch into one row")
    window = parser.add_mutually_exclusive_group()
    window.add_argument("--grad-accum", type=int, default=4, help="steps per optimizer window")
    window.add_argument("--tokens-per-update", type=int, help="loss tokens per optimizer window")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(tiny_llama())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    loader = ODBDataLoader(
        ChatSFT(args.samples),
        token_budget=args.token_budget,
        collate_fn=pack_collate if args.packed else pad_collate,
        cost_model="packed" if args.packed else "padded",
        grad_accum_steps=None if args.tokens_per_update else args.grad_accum,
        tokens_per_update=args.tokens_per_update,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        shuffle=True,
        seed=0,
    )
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        steps = updates = pads = 0
        stats = torch.zeros(3, dtype=torch.float64)  # Σ token CE, loss tokens, samples
        for batch in loader:
            meta = pop_step_meta(batch)  # removes batch["odb_step"]
            labels = batch.pop("labels")
            # All-reduce only on the window's closing micro-step.
            with contextlib.nullcontext() if meta.sync_gradients else model.no_sync():
                logits = model(**batch).logits
                # Σ token CE x W / window loss tokens: after DDP's average over the
                # ranks, the window's gradient is the global per-token mean.
                loss = causal_lm_loss(meta, logits, labels)
                loss.backward()
            if meta.sync_gradients:
                opt.step()
                opt.zero_grad(set_to_none=True)
                updates += 1
            steps += 1
            pads += int(meta.is_pad)
            if meta.loss_scale:
                ce_sum = loss.item() * meta.window_loss_tokens / meta.world_size
                stats += torch.tensor([ce_sum, meta.local_loss_tokens, meta.local_samples])
        dist.all_reduce(stats)
        if rank == 0:
            ce, tokens, samples = stats.tolist()
            print(
                f"epoch {epoch}: {steps} aligned steps, {updates} optimizer updates, "
                f"{int(samples)} samples (dataset {args.samples}), rank 0 pad steps {pads}, "
                f"mean loss {ce / tokens:.3f} over {int(tokens)} loss tokens"
            )
    loader.close()  # its protocol thread and workers end here, not at exit
    if rank == 0:
        print(f"done on {world} ranks")


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    train(args)
    # Tear down only once `train` has returned: while the DDP model is alive its
    # reducer holds the process group, and a group freed by the reducer is freed
    # with the GIL held while gloo's thread may wait for the GIL (pytorch#56297):
    # a hang at exit. The barrier lets gloo's thread finish the last collective.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
