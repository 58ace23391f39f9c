"""Batch formers: pure functions from a window of observed samples to batches + leftovers.

Contract (checked by the tests and, through the protocol, by the model checker):
the batches and the leftovers partition the window exactly (nothing lost, nothing
duplicated); with `flush=True` the leftovers are empty; on a non-empty window at
least one batch is returned; every batch fits the budget unless it is a single
sample that does not fit alone (marked `oversize`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import NamedTuple

from odb_core.batch import Batch
from odb_core.cost import BatchStats, Budget, CostModel
from odb_core.sample import Sample


class FormerKind(enum.Enum):
    """Packing policy applied to a rank's window."""

    SORT_WINDOW_GREEDY = "greedy"
    """The ODB paper's policy: longest first, cut when the next sample would overflow."""
    BEST_FIT_DECREASING = "bfd"
    """Longest first, each sample into the fullest open batch it still fits."""


class FormResult(NamedTuple):
    batches: list[Batch]
    leftovers: list[Sample]


def _longest_first(window: Sequence[Sample]) -> list[Sample]:
    # Ties broken by id so the result never depends on arrival order.
    return sorted(window, key=lambda s: (-(s.tokens + s.visual_tokens), s.id))


def _seal(samples: list[Sample], budget: Budget, model: CostModel) -> Batch:
    oversize = len(samples) == 1 and not budget.fits_alone(samples[0], model)
    return Batch(tuple(samples), oversize)


def sort_window_greedy(
    window: Sequence[Sample], budget: Budget, model: CostModel, flush: bool
) -> FormResult:
    """Longest first; a batch is closed when the next sample would not fit.

    Without `flush`, the last (open) batch goes back as leftovers to meet later
    arrivals, unless it is the only batch: a full window must always progress.
    """
    batches: list[Batch] = []
    cur: list[Sample] = []
    stats = BatchStats()
    limit_n = budget.max_samples
    limit_p = budget.max_patches
    limit_t = budget.tokens
    cost = model.cost
    for s in _longest_first(window):
        length = s.tokens + s.visual_tokens
        nxt = BatchStats(
            stats.n + 1,
            length if length > stats.max_len else stats.max_len,
            stats.sum_len + length,
            stats.sum_sq + length * length,
            stats.sum_text + s.tokens,
            stats.sum_visual + s.visual_tokens,
            stats.patches + s.patches,
        )
        fits = (
            (limit_n is None or nxt.n <= limit_n)
            and (limit_p is None or nxt.patches <= limit_p)
            and cost(nxt) <= limit_t
        )
        if fits or not cur:
            cur.append(s)
            stats = nxt
        else:
            batches.append(_seal(cur, budget, model))
            cur = [s]
            stats = BatchStats().add(s)
    if not cur:
        return FormResult(batches, [])
    if flush or not batches:
        batches.append(_seal(cur, budget, model))
        return FormResult(batches, [])
    return FormResult(batches, cur)


def best_fit_decreasing(
    window: Sequence[Sample], budget: Budget, model: CostModel, flush: bool
) -> FormResult:
    """Longest first; each sample joins the open batch it leaves fullest, else opens one.

    Without `flush`, the least-filled batch goes back as leftovers (if there are
    two or more), so sparse batches wait for companions instead of being emitted.
    """
    bins: list[list[Sample]] = []
    stats: list[BatchStats] = []
    for s in _longest_first(window):
        best = -1
        best_cost = -1.0
        for j, st in enumerate(stats):
            cand = st.add(s)
            if budget.fits(cand, model):
                c = model.cost(cand)
                if c > best_cost:
                    best, best_cost = j, c
        if best < 0:
            bins.append([s])
            stats.append(BatchStats().add(s))
        else:
            bins[best].append(s)
            stats[best] = stats[best].add(s)
    if not bins:
        return FormResult([], [])
    leftovers: list[Sample] = []
    if not flush and len(bins) > 1:
        weakest = min(range(len(bins)), key=lambda j: (model.cost(stats[j]), j))
        leftovers = bins.pop(weakest)
    return FormResult([_seal(b, budget, model) for b in bins], leftovers)


Former = Callable[[Sequence[Sample], Budget, CostModel, bool], FormResult]


def fullest_batch(result: FormResult) -> FormResult:
    """Keep only the batch with the most real tokens (text + visual; the first
    such batch on a tie); every other batch goes back to the leftovers.

    An early form (a partial window, `RankMachine.form_early`) emits this: its
    other batches were cut from too few samples to be tight, and wait for later
    arrivals. The result still partitions the window."""
    if len(result.batches) <= 1:
        return result
    best = max(
        range(len(result.batches)),
        key=lambda j: (sum(s.tokens + s.visual_tokens for s in result.batches[j].samples), -j),
    )
    rest = [s for j, b in enumerate(result.batches) if j != best for s in b.samples]
    return FormResult([result.batches[best]], rest + list(result.leftovers))


def carried_first(
    former: Former,
    window: Sequence[Sample],
    carried: frozenset[int],
    budget: Budget,
    model: CostModel,
    flush: bool,
) -> FormResult:
    """`former` with the window's carried samples (quota mode: ids a past pass did
    not emit) formed ahead of fresh ones (proofs/cross_epoch_fairness.md).

    A window of carried samples only is formed as usual (its leftovers, carried,
    lead the next window). Once fresh samples share the window, the carried ones
    are sealed first (formed alone, flushed), the fresh ones fill what room those
    batches have left (longest first, first fit), and the rest are formed as
    usual. So every batch holding a carried id precedes every batch without one.
    Without a carried sample in the window this is `former` itself; the contract
    holds, since each part keeps it and a top-up only adds what fits."""
    if not carried:
        return former(window, budget, model, flush)
    new = [s for s in window if s.id not in carried]
    if len(new) == len(window) or not new:
        return former(window, budget, model, flush)
    head = former([s for s in window if s.id in carried], budget, model, True)
    bins = [list(b.samples) for b in head.batches]
    stats = [None if b.oversize else BatchStats.of(b.samples) for b in head.batches]
    rest: list[Sample] = []
    for s in _longest_first(new):
        for j, st in enumerate(stats):
            if st is not None and budget.fits(st.add(s), model):
                bins[j].append(s)
                stats[j] = st.add(s)
                break
        else:
            rest.append(s)
    batches = [Batch(tuple(b), h.oversize) for b, h in zip(bins, head.batches, strict=True)]
    if not rest:
        return FormResult(batches, [])
    tail = former(rest, budget, model, flush)
    return FormResult(batches + tail.batches, tail.leftovers)


FORMERS: dict[FormerKind, Former] = {
    FormerKind.SORT_WINDOW_GREEDY: sort_window_greedy,
    FormerKind.BEST_FIT_DECREASING: best_fit_decreasing,
}
