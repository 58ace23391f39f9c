"""The `grouped-estimate` baseline: LLaVA's `group_by_modality_length` as its
trainer runs it. Lengths are `modality_lengths` (words of text, positive for a
sample with images, negative without), read without preprocessing, so visual
tokens are unseen. Samples with images and text-only samples are grouped apart:
each set is shuffled, cut into megabatches of world x B, each megabatch sorted
longest first and split into `world` batches of balanced word totals; the
megabatches of both sets are shuffled together, and the two sets' last partial
megabatches go last, merged. The flat order then runs through a DataLoader at
batch size B sharded by Accelerate (`odb_core.bench.grouped.shard_plan`).
(Written from LLaVA's description of its sampler, not copied.)
"""

from __future__ import annotations

import torch


def _balanced(megabatch: list[int], lens: list[int], world: int) -> list[int]:
    """Split a longest-first megabatch into `world` equal-count chunks, each next
    sample to the chunk with the fewest words so far; the chunks end to end."""
    per = len(megabatch) // world if len(megabatch) % world == 0 else None
    if per is None:
        return megabatch
    chunks: list[list[int]] = [[] for _ in range(world)]
    totals = [0] * world
    for i in megabatch:
        open_ = [c for c in range(world) if len(chunks[c]) < per]
        c = min(open_, key=lambda k: totals[k])
        chunks[c].append(i)
        totals[c] += lens[i]
    return [i for ch in chunks for i in ch]


def _grouped(
    ids: list[int], lens: list[int], mega: int, world: int, gen: torch.Generator
) -> list[list[int]]:
    order = [ids[k] for k in torch.randperm(len(ids), generator=gen).tolist()]
    out = []
    for s in range(0, len(order), mega):
        m = sorted(order[s : s + mega], key=lambda i: -lens[i])
        out.append(_balanced(m, lens, world))
    return out


def modality_order(
    modality_lengths: list[int], batch_size: int, world: int, seed: int
) -> list[int]:
    """The epoch's sample order under LLaVA's modality grouping."""
    if any(n == 0 for n in modality_lengths):
        raise ValueError("modality_lengths must be non-zero (positive: images, negative: text)")
    lens = [abs(n) for n in modality_lengths]
    gen = torch.Generator()
    gen.manual_seed(seed)
    mega = world * batch_size
    mm = [i for i, n in enumerate(modality_lengths) if n > 0]
    lang = [i for i, n in enumerate(modality_lengths) if n < 0]
    if not mm or not lang:
        return [i for m in _grouped(mm or lang, lens, mega, world, gen) for i in m]
    mm_mega = _grouped(mm, lens, mega, world, gen)
    lang_mega = _grouped(lang, lens, mega, world, gen)
    tail = sorted(mm_mega[-1] + lang_mega[-1])
    full = mm_mega[:-1] + lang_mega[:-1]
    full = [full[k] for k in torch.randperm(len(full), generator=gen).tolist()]
    return [i for m in [*full, tail] for i in m]


def grouped_estimate_plan(
    modality_lengths: list[int], batch_size: int, world: int, seed: int
) -> list[list[list[int]]]:
    from odb_core.bench.grouped import shard_plan

    return shard_plan(modality_order(modality_lengths, batch_size, world, seed), batch_size, world)
