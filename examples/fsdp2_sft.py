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
import random
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from odb_core import ODBDataLoader
from odb_core.torch import causal_lm_loss, pop_step_meta

PAD, BOS, SEP, EOS = 0, 1, 2, 3
VOCAB = 128
IGNORE = -100


class ChatSFT(Dataset[dict[str, torch.Tensor]]):
    """`[BOS] prompt [SEP] response [EOS]`, labels masked on the prompt part;
    long-tailed lengths; with `uneven`, even-numbered samples are 3x longer."""

    def __init__(self, n: int, uneven: bool) -> None:
        self.n = n
        self.uneven = uneven

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rng = random.Random(i)
        prompt_len = min(128, max(2, int(rng.lognormvariate(2.8, 0.7))))
        response_len = min(96, max(1, int(rng.lognormvariate(2.4, 0.8))))
        if self.uneven and i % 2 == 0:
            prompt_len, response_len = 3 * prompt_len, 3 * response_len
        words = VOCAB - 4
        prompt = [4 + rng.randrange(words) for _ in range(prompt_len)]
        response = [4 + (prompt[-1] * 3 + 1) % words]
        for _ in range(response_len - 1):  # learnable: a chain seeded by the prompt
            response.append(4 + (response[-1] * 5 + 7) % words)
        ids = torch.tensor([BOS, *prompt, SEP, *response, EOS])
        labels = ids.clone()
        labels[: prompt_len + 2] = IGNORE  # no loss on the prompt
        return {"input_ids": ids, "labels": labels}


def pad_collate(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    pad = torch.nn.utils.rnn.pad_sequence
    ids = [s["input_ids"] for s in samples]
    return {
        "input_ids": pad(ids, batch_first=True, padding_value=PAD),
        "labels": pad([s["labels"] for s in samples], batch_first=True, padding_value=IGNORE),
        "attention_mask": pad([torch.ones_like(x) for x in ids], batch_first=True),
    }


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        use_cache=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


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

    model = tiny_llama().to(device) if device is not None else tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    loader = ODBDataLoader(  # after init_process_group: it splits the data over the ranks
        ChatSFT(args.samples, uneven=not args.even),
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
