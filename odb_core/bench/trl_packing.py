"""The `trl-packed` strategy's plan: TRL's own offline packing (`SFTConfig(packing=
True)`, best-fit decreasing) over the lengths of a full preprocessing pass.

TRL packs a tokenized dataset into rows of `max_length` tokens with
`trl.data_utils.pack_dataset(..., strategy="bfd")`, and the Trainer then reads
those rows through a `DistributedSampler`, one row per device and step. Here
each sample's tokens are its own id repeated `length` times, so the rows TRL
forms name the samples they hold; the bench then collates those samples as one
packed row (per-sample positions, varlen attention), as TRL's padding-free
collator does. The pass, tokenizing every sample to learn its length, and the
packing itself are the strategy's precompute.
"""

from __future__ import annotations

import random
import time

__all__ = ["trl_bfd_plan"]


def trl_bfd_plan(
    lens: list[int], budget: int, world: int, seed: int
) -> tuple[list[list[list[int]]], float]:
    """TRL's BFD rows of at most `budget` tokens, each the list of its sample ids,
    shuffled (seeded) and dealt round-robin; every rank's list of rows, and the
    seconds TRL's packing took. A sample longer than `budget` would be truncated
    by TRL's "bfd": refused here, since the bench must train every token."""
    from datasets import Dataset, disable_progress_bars  # type: ignore[import-untyped]
    from trl.data_utils import pack_dataset

    disable_progress_bars()  # a bench rank's stderr carries the progress lines

    over = [i for i, n in enumerate(lens) if n > budget]
    if over:
        raise ValueError(
            f"trl-packed: sample {over[0]} has {lens[over[0]]} tokens > the budget "
            f"{budget}; TRL's bfd would truncate it (raise --budget or lower --max-len)"
        )
    t0 = time.perf_counter()
    ds = Dataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lens)]})
    packed = pack_dataset(ds, seq_length=budget, strategy="bfd")
    took = time.perf_counter() - t0
    rows: list[list[int]] = []
    for tokens in packed["input_ids"]:
        ids = list(dict.fromkeys(tokens))  # each sample's run of its id, in order
        rows.append(ids)
    seen = sorted(i for row in rows for i in row)
    if seen != list(range(len(lens))):
        raise AssertionError(f"TRL's bfd rows hold {len(seen)} ids of {len(lens)}")
    random.Random(seed).shuffle(rows)
    return [rows[r::world] for r in range(world)], took
