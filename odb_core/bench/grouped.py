"""The `grouped` baseline: HF Trainer's `group_by_length=True` as a user runs it.

HF Trainer builds `LengthGroupedSampler(train_batch_size * gradient_accumulation_steps,
lengths)` (megabatches of min(50, N // 4B) x B samples, each sorted longest first, the
longest batch first) and a `DataLoader(batch_size=B)` over it; Accelerate's `prepare`
shards that DataLoader with `BatchSamplerShard(split_batches=False, even_batches=True)`:
consecutive batches go to consecutive ranks, and the tail wraps round to the epoch's
first samples so every rank runs the same number of full batches. HF's and
Accelerate's own classes are used here, not copies. The lengths must be known up
front (HF reads them from the dataset: a pass over it).
"""

from __future__ import annotations

import torch
from torch.utils.data import BatchSampler


def grouped_plan(
    lengths: list[int], batch_size: int, world: int, seed: int
) -> list[list[list[int]]]:
    """Every rank's batches for one epoch (the same generator seed on every rank, as
    Accelerate synchronises it), in the order each rank runs them."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    gen = torch.Generator()
    gen.manual_seed(seed)
    sampler = LengthGroupedSampler(batch_size, lengths=lengths, generator=gen)
    gen.manual_seed(seed)
    return shard_plan(list(sampler), batch_size, world)


def shard_plan(order: list[int], batch_size: int, world: int) -> list[list[list[int]]]:
    """A sampler's epoch order as `DataLoader(batch_size=B)` batches sharded by
    Accelerate: every rank's batches, in the order it runs them."""
    from accelerate.data_loader import BatchSamplerShard  # type: ignore[import-untyped]

    plan = []
    for rank in range(world):
        batches = BatchSampler(order, batch_size, drop_last=False)
        shard = BatchSamplerShard(
            batches, num_processes=world, process_index=rank, split_batches=False, even_batches=True
        )
        plan.append([list(b) for b in shard])
    return plan
