"""SFT with Hugging Face Accelerate and ODBDataLoader (2 ranks on CPU, or GPUs).

    torchrun --nproc_per_node 2 examples/accelerate_sft.py
    torchrun --nproc_per_node 2 examples/accelerate_sft.py --save-at-update 3 --ckpt ckpt
    torchrun --nproc_per_node 2 examples/accelerate_sft.py --resume ckpt
    (or `accelerate launch --num_processes 2 --cpu examples/accelerate_sft.py`)

A tiny random-init `LlamaForCausalLM` learns chat samples whose prompts are
masked (-100). What changes from an Accelerate loop with a DataLoader:

- `Accelerator()` keeps `gradient_accumulation_steps=1`: the loader decides the
  optimizer windows (`grad_accum_steps=G`, the same step on every rank) and its
  loss scale already normalises over the whole window, so Accelerate must not
  divide the loss or count windows again;
- `train = prepare_odb_loader(accelerator, loader)` instead of
  `accelerator.prepare(loader)`: batches on `accelerator.device`,
  `accelerator.sync_gradients` True on each window's last step (the epoch's short
  last window too), `end_of_dataloader` on the epoch's last batch, and the
  loader's position saved by `accelerator.save_state` (no `skip_first_batches`);
- `with train.accumulate(model):` where `accelerator.accumulate(model)` would go;
  the prepared optimizer and scheduler step only where a window closes;
- `scaled_loss(meta, model(**batch).loss)` with `meta = pop_step_meta(batch)`;
- `ProgressLR(optimizer, train, epochs=...)`: the LR schedule on the run's
  progress, prepared like any scheduler.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator

from odb_core import ODBDataLoader
from odb_core.integrations.accelerate import prepare_odb_loader
from odb_core.torch import ProgressLR, pop_step_meta, scaled_loss

from sft_data import MEDIUM, ChatSFT, pad_collate, tiny_llama


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--grad-accum", type=int, default=2, help="steps per optimizer window")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--ckpt", help="folder for accelerator.save_state")
    parser.add_argument("--save-at-update", type=int, help="save after this optimizer update")
    parser.add_argument("--resume", help="accelerator.load_state from this folder first")
    return parser.parse_args()


def train_epochs(args: argparse.Namespace, accelerator: Accelerator) -> None:
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = ODBDataLoader(  # after Accelerator(): it splits the data over the ranks
        ChatSFT(args.samples, MEDIUM),
        token_budget=args.token_budget,
        collate_fn=pad_collate,
        cost_model="padded",
        grad_accum_steps=args.grad_accum,
        shuffle=True,
        seed=0,
    )
    train = prepare_odb_loader(accelerator, loader)
    # Linear decay to a tenth on the run's exact progress (samples consumed over
    # epochs x dataset): it ends on the last update whatever the step count, and the
    # num_processes calls per update Accelerate makes change nothing.
    scheduler = ProgressLR(optimizer, train, epochs=args.epochs, shape="linear", final=0.1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if args.resume:
        accelerator.load_state(args.resume)  # model, optimizer, scheduler, RNG, loader position
        accelerator.print(f"resumed epoch {train.epoch} after step {loader.state_dict()['step']}")

    updates_done = 0
    first_epoch = train.epoch
    for epoch in range(first_epoch, args.epochs):  # each iteration is the loader's next epoch
        steps = updates = pads = 0
        stats = torch.zeros(3, dtype=torch.float64, device=accelerator.device)
        for batch in train:
            meta = pop_step_meta(batch)  # on accelerator.device, like the batch
            with train.accumulate(model):
                loss = scaled_loss(meta, model(**batch).loss)  # exact global per-token mean
                accelerator.backward(loss)
                optimizer.step()  # these three are no-ops until the window closes
                scheduler.step()
                optimizer.zero_grad()
            steps += 1
            pads += int(meta.is_pad)
            if accelerator.sync_gradients:
                updates += 1
                updates_done += 1
                if args.ckpt and updates_done == args.save_at_update:
                    accelerator.save_state(args.ckpt)  # every rank; rank 0 writes
                    accelerator.print(f"saved {args.ckpt} at step {meta.step} of epoch {epoch}")
            if meta.loss_scale:
                ce_sum = loss.item() / meta.loss_scale * meta.local_loss_tokens
                stats += torch.tensor(
                    [ce_sum, meta.local_loss_tokens, meta.local_samples],
                    dtype=torch.float64,
                    device=accelerator.device,
                )
        ce, tokens, samples = accelerator.reduce(stats, reduction="sum").tolist()
        accelerator.print(
            f"epoch {epoch}: {steps} aligned steps, {updates} optimizer updates, "
            f"{int(samples)} samples (dataset {args.samples}), rank 0 pad steps {pads}, "
            f"estimate {len(train)}, mean loss {ce / max(tokens, 1):.3f} over {int(tokens)} "
            f"loss tokens, lr {scheduler.get_last_lr()[0]:.2e}"
        )
    train.close()  # the loader's protocol thread ends here, not at exit
    accelerator.print(f"done on {accelerator.num_processes} ranks")


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # starts the process group
    train_epochs(args, accelerator)
    # Tear down once the model is gone: while it is alive it holds the process group,
    # and a group freed by the model is freed with the GIL held while gloo's thread
    # may wait for the GIL (pytorch#56297): a hang at exit. `free_memory` drops the
    # accelerator's own references; the barrier lets gloo finish the last collective.
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process groups


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
