"""Length-grouped fixed batches, as users already run them: the `grouped` and
`grouped-modality` baselines.

`grouped` is HF Trainer's `group_by_length=True`: transformers'
`LengthGroupedSampler` (`get_length_grouped_indices` in `trainer_pt_utils.py`)
over the whole dataset with the Trainer's sampler batch size
(`train_batch_size * gradient_accumulation_steps`, `train_batch_size` being the
per-device batch under DDP), batched by a `BatchSampler(drop_last=False)` and
sharded across ranks by Accelerate's `BatchSamplerShard` (`split_batches=False`,
`even_batches=True`): consecutive batches to consecutive ranks, the last global
step completed with samples from the start of the epoch.

`grouped-modality` is LLaVA's `group_by_modality_length`
(`llava/train/llava_trainer.py`, `get_modality_length_grouped_indices`):
multimodal and text-only samples in separate megabatches of `world_size * B`,
each sorted longest first and dealt into `world_size` chunks of balanced total
length, the megabatches of both kinds shuffled together.

These are equivalents written from the public code, not copies; with
transformers and accelerate installed, `tests/test_grouped.py` checks the HF
path index for index against the real functions. Randomness comes from the
caller's permutations (HF draws them with `torch.randperm`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

Permute = Callable[[int], list[int]]
"""Returns a random permutation of range(n) (the caller's seeded RNG)."""


def hf_mega_batch_mult(n: int, batch_size: int) -> int:
    """transformers' default: 50, or the number that gives 4 megabatches if smaller, at least 1."""
    return max(1, min(n // (batch_size * 4), 50))


def length_grouped_indices(
    lengths: Sequence[int], batch_size: int, perm: Sequence[int]
) -> list[int]:
    """HF `get_length_grouped_indices` given its random permutation `perm`: megabatches
    of `mega_batch_mult * batch_size` consecutive indices of `perm`, each sorted longest
    first (a stable sort, as Python's `sorted(..., reverse=True)`), then the longest
    sample of all swapped into the first position of the first megabatch."""
    size = hf_mega_batch_mult(len(lengths), batch_size) * batch_size
    mbs = [
        sorted(perm[i : i + size], key=lambda j: lengths[j], reverse=True)
        for i in range(0, len(perm), size)
    ]
    if not mbs:
        return []
    heads = [lengths[mb[0]] for mb in mbs]
    top = heads.index(max(heads))  # torch.argmax returns the first maximum too
    mbs[0][0], mbs[top][0] = mbs[top][0], mbs[0][0]
    return [i for mb in mbs for i in mb]


def _even_chunks(indices: list[int], lengths: Sequence[int], chunks: int) -> list[list[int]]:
    """LLaVA's `split_to_even_chunks`: each index (longest first) to the chunk with the
    least total length that still has room; a strided split when the sizes do not divide."""
    if len(indices) % chunks:
        return [indices[i::chunks] for i in range(chunks)]
    per = len(indices) // chunks
    out: list[list[int]] = [[] for _ in range(chunks)]
    # LLaVA scans for the first chunk of least total (a full one counts as infinite);
    # a heap of (total, chunk) picks the same one in O(log chunks).
    heap = [(0, k) for k in range(chunks)]
    for i in indices:
        total, k = heapq.heappop(heap)
        out[k].append(i)
        if len(out[k]) < per:
            heapq.heappush(heap, (total + lengths[i], k))
    return out


def _llava_grouped(
    lengths: Sequence[int], batch_size: int, world: int, perm: list[int]
) -> list[int]:
    size = world * batch_size
    out: list[int] = []
    for i in range(0, len(perm), size):
        mb = sorted(perm[i : i + size], key=lambda j: lengths[j], reverse=True)
        out += [j for chunk in _even_chunks(mb, lengths, world) for j in chunk]
    return out


def modality_grouped_indices(
    lengths: Sequence[int],
    multimodal: Sequence[bool],
    batch_size: int,
    world: int,
    permute: Permute,
) -> list[int]:
    """LLaVA `get_modality_length_grouped_indices`. LLaVA asserts both modalities are
    present; a workload with one modality here simply has an empty other group."""
    mm = [i for i in range(len(lengths)) if multimodal[i]]
    lang = [i for i in range(len(lengths)) if not multimodal[i]]
    size = world * batch_size

    def megabatches(group: list[int]) -> list[list[int]]:
        sub = [lengths[i] for i in group]
        order = [group[j] for j in _llava_grouped(sub, batch_size, world, permute(len(group)))]
        return [order[i : i + size] for i in range(0, len(order), size)]

    mm_mb, lang_mb = megabatches(mm), megabatches(lang)
    extra = (mm_mb[-1] if mm_mb else []) + (lang_mb[-1] if lang_mb else [])
    full = mm_mb[:-1] + lang_mb[:-1]
    mbs = [full[k] for k in permute(len(full))]
    if len(extra) >= size:
        mbs = [extra[:size], *mbs]
        extra = extra[size:]
    if extra:
        mbs.append(extra)
    return [i for mb in mbs for i in mb]


def accelerate_shard(order: Sequence[int], batch_size: int, world: int) -> list[list[list[int]]]:
    """Per-rank batch lists of `BatchSampler(order, batch_size, drop_last=False)` sharded
    by Accelerate's `BatchSamplerShard(split_batches=False, even_batches=True)`: batch k
    to rank k mod W; a short last batch, and a last global step that not every rank
    reaches, are completed by cycling through the first W batches' samples."""
    batches = [list(order[i : i + batch_size]) for i in range(0, len(order), batch_size)]
    plan: list[list[list[int]]] = [[] for _ in range(world)]
    if not batches:
        return plan
    initial = [i for b in batches[:world] for i in b]
    while len(initial) < world * batch_size:
        initial += initial
    cycle = batch_size - len(batches[-1])
    batches[-1] = batches[-1] + initial[:cycle]
    while len(batches) % world:
        batches.append(initial[cycle : cycle + batch_size])
        cycle += batch_size
    for j, b in enumerate(batches):
        plan[j % world].append(b)
    return plan
