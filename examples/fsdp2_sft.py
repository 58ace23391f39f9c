"""SFT with FSDP2 (`fully_shard`) and ODBDataLoader on uneven data, CPU or GPU.

    torchrun --nproc_per_node 2 examples/fsdp2_sft.py
    torchrun --nproc_per_node 2 examples/fsdp2_sft.py --even --grad-accum 1

A tiny random-init `LlamaForCausalLM`, each decoder layer and the root sharded
with `fully_shard`, learns chat samples whose prompts are masked (-100). The
data is uneven on purpose: even-numbered samples are three times longer and the
order is not shuffled, so rank 0 (even positions) holds about three times rank
1's tokens. Rank 1 runs out first; the loader then gives it pad steps (loss
scale 0). A pad step still runs forward and backward, so FSDP's all-gathers and
reduce-scatters line up on every rank and nothing hangs, and it adds nothing to
the gradient. The update is exactly the per-token mean over the window's global
samples.

What changes from a plain FSDP2 loop:
- `ODBDataLoader(..., token_budget=..., grad_accum_steps=G)` instead of a
  DataLoader with a batch size and a DistributedSampler;
- `meta = pop_step_meta(batch)`, `causal_lm_loss(meta, logits, labels)`;
- `model.set_requires_gradient_sync(meta.sync_gradients)`: FSDP2 reduces the
  gradients only on the window's closing micro-step, where the optimizer steps.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from odb_core import ODBDataLoader
from odb_core.torch import causal_lm_loss, pop_step_meta

from sft_data import SHORT, ChatSFT, pad_collate, tiny_llama


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--grad-accum", type=int, default=2, help="steps per optimizer window")
    parser.add_argument("--even", action="store_true", help="balanced, shuffled data instead")
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if device is not None:
        torch.cuda.set_device(device)

    model = tiny_llama(2048)
    model = model.to(device) if device is not None else model
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    loader = ODBDataLoader(  # after init_process_group: it splits the data over the ranks
        ChatSFT(args.samples, SHORT, uneven=not args.even),
        token_budget=args.token_budget,
        collate_fn=pad_collate,
        cost_model="padded",
        grad_accum_steps=args.grad_accum,
        shuffle=args.even,  # unshuffled: rank 0 gets the long (even) samples
        seed=0,
    )
    for epoch in range(args.epochs):  # each iteration of the loader is its next epoch
        steps = updates = 0
        pads = torch.zeros(world, dtype=torch.float64)
        stats = torch.zeros(3, dtype=torch.float64)  # Σ token CE, loss tokens, samples
        for batch in loader:
            meta = pop_step_meta(batch)  # removes batch["odb_step"]
            if device is not None:
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            # Reduce-scatter only on the window's closing micro-step; every rank
            # closes the same window at the same step.
            model.set_requires_gradient_sync(meta.sync_gradients)
            logits = model(**batch).logits  # a pad step runs too: the collectives line up
            loss = causal_lm_loss(meta, logits, labels)
            loss.backward()
            if meta.sync_gradients:
                opt.step()
                opt.zero_grad(set_to_none=True)
                updates += 1
            steps += 1
            pads[rank] += int(meta.is_pad)
            if meta.loss_scale:
                ce_sum = loss.item() * meta.window_loss_tokens / meta.world_size
                stats += torch.tensor([ce_sum, meta.local_loss_tokens, meta.local_samples])
        if cuda:
            stats, pads = stats.cuda(), pads.cuda()
        dist.all_reduce(stats)
        dist.all_reduce(pads)
        if rank == 0:
            ce, tokens, samples = stats.tolist()
            print(
                f"epoch {epoch}: {steps} aligned steps, {updates} optimizer updates, "
                f"{int(samples)} samples (dataset {args.samples}), "
                f"pad steps {[int(p) for p in pads.tolist()]}, "
                f"mean loss {ce / tokens:.3f} over {int(tokens)} loss tokens",
                flush=True,
            )
    loader.close()  # its protocol thread ends here, not at exit
    if rank == 0:
        print(f"done on {world} ranks")


def main() -> None:
    args = parse_args()
    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    train(args)
    # Tear down only once `train` has returned: while the model is alive it holds
    # the process group, and a group freed by the model is freed with the GIL held
    # while gloo's thread may wait for the GIL (pytorch#56297): a hang at exit. The
    # barrier lets gloo's thread finish the last collective.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
