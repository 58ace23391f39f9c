"""A plain DDP training loop on CPU with ODBDataLoader and gradient accumulation.

    torchrun --nproc_per_node 2 examples/train_ddp.py

The changes from a DataLoader loop: the loader (a token budget instead of a batch
size; `grad_accum_steps` instead of counting micro-steps yourself), and the loss:
each batch carries its step metadata (`pop_step_meta`), and `causal_lm_loss`
scales the summed token loss by W / (the window's loss tokens over all ranks), so
that after DDP averages the gradients, the update of each optimizer window is the
exact mean over every loss token (labels not masked) of the window, on every rank.
Pad steps (a rank with nothing left) scale to 0 but still run their backward, so
DDP's all-reduce lines up. Micro-steps that do not close their window skip the
all-reduce with `no_sync()`; every rank agrees on which ones those are.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from odb_core import ODBDataLoader, causal_lm_loss, pad_collate, pop_step_meta

VOCAB = 256


class ToyChat(Dataset[dict[str, torch.Tensor]]):
    """Variable-length 'tokenised' chats: the cost is only known after processing.
    Labels are aligned with input_ids (HF style); the prompt's are masked (-100)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rng = random.Random(i)
        length = max(4, int(rng.lognormvariate(3.5, 0.7)))  # "after templating"
        ids = [rng.randrange(VOCAB)]
        for _ in range(length - 1):  # a learnable bigram chain
            ids.append((ids[-1] * 7 + 3) % VOCAB)
        input_ids = torch.tensor(ids)
        labels = input_ids.clone()
        labels[: rng.randrange(1, length)] = -100  # the prompt does not train
        return {"input_ids": input_ids, "labels": labels}


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # A bigram model: each position sees only its own token, so padding on the
        # right changes nothing and the mask `pad_collate` adds is not needed.
        logits: torch.Tensor = self.head(self.emb(input_ids))
        return logits


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # Was: DataLoader(ToyChat(n), batch_size=8, sampler=DistributedSampler(...), ...)
    loader = ODBDataLoader(
        ToyChat(args.samples),
        token_budget=args.token_budget,
        collate_fn=pad_collate,  # right-pads; labels -100 on padding
        grad_accum_steps=args.grad_accum,  # optimizer windows of G aligned steps
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        shuffle=True,
        seed=0,
    )
    for _ in range(args.epochs):  # iterating again starts the next epoch (or: set_epoch)
        seen = steps = updates = 0
        window_loss = torch.zeros(())
        last = float("nan")
        for batch in loader:
            meta = pop_step_meta(batch)  # this batch's own step, window and counts
            labels = batch.pop("labels")
            sync = contextlib.nullcontext() if meta.sync_gradients else model.no_sync()
            with sync:  # all-reduce only on the backward that closes the window
                loss = causal_lm_loss(meta, model(**batch), labels)  # 0 on pad steps
                loss.backward()
            window_loss += loss.detach()
            if meta.sync_gradients:
                opt.step()
                opt.zero_grad(set_to_none=True)
                updates += 1
                dist.all_reduce(window_loss)  # sum over ranks / W = the window's mean
                last = window_loss.item() / world
                window_loss.zero_()
            seen += meta.local_samples
            steps += 1
        total = torch.tensor([seen])  # every sample exactly once across ranks
        dist.all_reduce(total)
        if rank == 0:
            print(
                f"epoch {loader.epoch}: {steps} aligned steps, {updates} updates, "
                f"{int(total)} samples (dataset {args.samples}), last window loss {last:.3f}"
            )
    if rank == 0:
        state = loader.state_dict()  # plain data; resume with load_state_dict
        print(f"done on {world} ranks; resumable state at step {state['step']}")


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
