"""A plain DDP training loop on CPU with ODBDataLoader.

    torchrun --nproc_per_node 2 examples/train_ddp.py

The only changes from a DataLoader loop: the loader (a token budget instead of a
batch size) and one line that scales the loss, so that after DDP averages the
gradients the update is the exact mean over every real token of the global step.
"""

from __future__ import annotations

import argparse
import os
import random

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from odb_core import ODBDataLoader

VOCAB = 256


class ToyChat(Dataset[dict[str, torch.Tensor]]):
    """Variable-length 'tokenised' samples: the cost is only known after processing."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rng = random.Random(i)
        length = max(4, int(rng.lognormvariate(3.5, 0.7)))  # "after templating"
        ids = [rng.randrange(VOCAB)]
        for _ in range(length):  # a learnable bigram chain
            ids.append((ids[-1] * 7 + 3) % VOCAB)
        t = torch.tensor(ids)
        return {"input_ids": t[:-1], "labels": t[1:]}


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    pad = nn.utils.rnn.pad_sequence
    return {
        "input_ids": pad([s["input_ids"] for s in samples], batch_first=True),
        "labels": pad([s["labels"] for s in samples], batch_first=True, padding_value=-100),
    }


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(input_ids))
        # Mean over this rank's real tokens; loss_scale turns it into the global mean.
        loss: torch.Tensor = nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100
        )
        return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # Was: DataLoader(ToyChat(n), batch_size=8, sampler=DistributedSampler(...), ...)
    loader = ODBDataLoader(
        ToyChat(args.samples),
        token_budget=args.token_budget,
        collate_fn=collate,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        shuffle=True,
        seed=0,
    )
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        seen = steps = 0
        last = float("nan")
        for batch in loader:
            raw = model(**batch)
            loss = loader.scale_loss(raw)  # pad steps scale to 0
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            info = loader.step_info
            assert info is not None
            seen += info.local_samples
            steps += 1
            if not info.is_pad:
                last = raw.item()
        total = torch.tensor([seen])  # every sample exactly once across ranks
        dist.all_reduce(total)
        if rank == 0:
            print(
                f"epoch {epoch}: {steps} aligned steps, {int(total)} samples "
                f"(dataset {args.samples}), rank 0 loss {last:.3f}"
            )
    if rank == 0:
        state = loader.state_dict()  # plain data; resume with load_state_dict
        print(f"done on {dist.get_world_size()} ranks; resumable state at step {state['step']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
