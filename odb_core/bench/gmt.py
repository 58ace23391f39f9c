"""The `gmt` oracle's plan: global max tokens over a full length cache."""

from __future__ import annotations

import random


def gmt_plan(lens: list[int], budget: int, world: int, seed: int) -> list[list[list[int]]]:
    """Sort longest first, cut when n x max_len would pass the budget, shuffle the
    batches (seeded), deal them round-robin; every rank's list of batches."""
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lens[cur[0]] > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    random.Random(seed).shuffle(batches)
    return [batches[r::world] for r in range(world)]
