"""Batch formers: partition contract, budget safety, oversize handling."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core.batch import Batch
from odb_core.cost import AttentionAware, BatchStats, Budget, CostModel, PackedTokens, PaddedTokens
from odb_core.formers import FORMERS, Former, FormerKind, FormResult, sort_window_greedy
from odb_core.sample import Sample

MODELS: list[CostModel] = [PackedTokens(), PaddedTokens(), AttentionAware(alpha=0.01)]

windows = st.lists(
    st.tuples(st.integers(1, 60), st.integers(0, 20), st.integers(0, 3)), min_size=0, max_size=40
).map(lambda xs: [Sample(i, t, v, p) for i, (t, v, p) in enumerate(xs)])


def contract_violations(
    former: Former, window: list[Sample], b: Budget, model: CostModel, flush: bool
) -> list[str]:
    """Every clause of the former contract (module docstring of odb_core.formers)."""
    result = former(window, b, model, flush)
    out: list[str] = []
    emitted = [s for batch in result.batches for s in batch.samples] + result.leftovers
    if Counter(emitted) != Counter(window):
        out.append("batches + leftovers are not a partition of the window")
    if flush and result.leftovers:
        out.append("leftovers after a flush")
    if window and not result.batches:
        out.append("a non-empty window formed no batch")
    for batch in result.batches:
        if not batch.samples:
            out.append("an empty batch")
            continue
        fits = b.fits(BatchStats.of(batch.samples), model)
        if not (fits or (len(batch.samples) == 1 and batch.oversize)):
            out.append(f"batch {batch.ids} over budget")
        if batch.oversize != (not fits):
            out.append(f"batch {batch.ids} oversize flag is {batch.oversize}")
    return out


@settings(max_examples=200, deadline=None)
@given(
    window=windows,
    kind=st.sampled_from(list(FormerKind)),
    model=st.sampled_from(MODELS),
    budget=st.integers(20, 200),
    max_samples=st.none() | st.integers(1, 8),
    max_patches=st.none() | st.integers(1, 6),
    flush=st.booleans(),
)
def test_former_contract(
    window: list[Sample],
    kind: FormerKind,
    model: CostModel,
    budget: int,
    max_samples: int | None,
    max_patches: int | None,
    flush: bool,
) -> None:
    b = Budget(budget, max_samples, max_patches)
    assert contract_violations(FORMERS[kind], window, b, model, flush) == []


def _drops_leftovers(w: Sequence[Sample], b: Budget, m: CostModel, flush: bool) -> FormResult:
    return FormResult(sort_window_greedy(w, b, m, flush).batches, [])


def _one_batch(w: Sequence[Sample], b: Budget, m: CostModel, flush: bool) -> FormResult:
    return FormResult([Batch(tuple(w), False)] if w else [], [])


def _holds_all(w: Sequence[Sample], b: Budget, m: CostModel, flush: bool) -> FormResult:
    return FormResult([], list(w))


def _duplicates_head(w: Sequence[Sample], b: Budget, m: CostModel, flush: bool) -> FormResult:
    r = sort_window_greedy(w, b, m, flush)
    return FormResult(r.batches, [*r.leftovers, r.batches[0].samples[0]])


@pytest.mark.parametrize(
    "broken", [_drops_leftovers, _one_batch, _holds_all, _duplicates_head], ids=lambda f: f.__name__
)
def test_a_broken_former_is_caught_by_the_contract(broken: Former) -> None:
    window = [Sample(0, 3), Sample(1, 5), Sample(2, 2), Sample(3, 4)]
    found = contract_violations(broken, window, Budget(9), PackedTokens(), flush=False)
    assert found, f"{broken.__name__} passed the contract"


def test_greedy_is_longest_first_and_cuts_at_budget() -> None:
    window = [Sample(0, 3), Sample(1, 5), Sample(2, 2), Sample(3, 4)]
    r = sort_window_greedy(window, Budget(9), PackedTokens(), flush=True)
    assert [b.ids for b in r.batches] == [(1, 3), (0, 2)]


def test_greedy_keeps_open_batch_as_leftover() -> None:
    window = [Sample(0, 3), Sample(1, 5), Sample(2, 2), Sample(3, 4)]
    r = sort_window_greedy(window, Budget(9), PackedTokens(), flush=False)
    assert [b.ids for b in r.batches] == [(1, 3)]
    assert sorted(s.id for s in r.leftovers) == [0, 2]


def test_greedy_emits_single_open_batch_of_a_full_window() -> None:
    r = sort_window_greedy([Sample(0, 1), Sample(1, 1)], Budget(9), PackedTokens(), flush=False)
    assert [b.ids for b in r.batches] == [(0, 1)] and r.leftovers == []


def test_ties_are_broken_by_id_not_arrival() -> None:
    a = [Sample(5, 4), Sample(2, 4), Sample(9, 4)]
    r1 = sort_window_greedy(a, Budget(8), PackedTokens(), flush=True)
    r2 = sort_window_greedy(a[::-1], Budget(8), PackedTokens(), flush=True)
    assert r1 == r2 and r1.batches[0].ids == (2, 5)


def test_padded_budget_accounts_for_padding() -> None:
    window = [Sample(0, 10), Sample(1, 1), Sample(2, 1)]
    r = sort_window_greedy(window, Budget(20), PaddedTokens(), flush=True)
    assert [b.ids for b in r.batches] == [(0, 1), (2,)]


def test_bfd_fills_the_fullest_bin() -> None:
    window = [Sample(0, 6), Sample(1, 5), Sample(2, 4), Sample(3, 4)]
    r = FORMERS[FormerKind.BEST_FIT_DECREASING](window, Budget(10), PackedTokens(), True)
    assert sorted(b.ids for b in r.batches) == [(0, 2), (1, 3)]


def test_oversize_sample_forms_a_flagged_solo_batch() -> None:
    window = [Sample(0, 50), Sample(1, 3), Sample(2, 3)]
    r = sort_window_greedy(window, Budget(10), PackedTokens(), flush=True)
    assert r.batches[0].ids == (0,) and r.batches[0].oversize
    assert not r.batches[1].oversize


@pytest.mark.parametrize("kind", list(FormerKind))
def test_empty_window(kind: FormerKind) -> None:
    r = FORMERS[kind]([], Budget(10), PackedTokens(), False)
    assert r.batches == [] and r.leftovers == []


def _ids(result: object) -> list[list[int]]:
    return [list(b.ids) for b in result.batches]  # type: ignore[attr-defined]


def test_best_fit_breaks_a_tie_towards_the_first_batch() -> None:
    # 6 and 6 open two batches; 3 leaves both equally full and joins the first.
    window = [Sample(0, 6), Sample(1, 6), Sample(2, 3)]
    r = FORMERS[FormerKind.BEST_FIT_DECREASING](window, Budget(10), PackedTokens(), True)
    assert _ids(r) == [[0, 2], [1]]


def test_best_fit_returns_the_least_filled_of_two_batches_as_leftovers() -> None:
    window = [Sample(0, 7), Sample(1, 5)]
    r = FORMERS[FormerKind.BEST_FIT_DECREASING](window, Budget(10), PackedTokens(), False)
    assert _ids(r) == [[0]]
    assert [s.id for s in r.leftovers] == [1]
    flushed = FORMERS[FormerKind.BEST_FIT_DECREASING](window, Budget(10), PackedTokens(), True)
    assert _ids(flushed) == [[0], [1]] and flushed.leftovers == []


def test_best_fit_puts_zero_cost_samples_together() -> None:
    # a batch of empty samples costs 0, which must still count as a fit
    window = [Sample(0, 0), Sample(1, 0), Sample(2, 0)]
    r = FORMERS[FormerKind.BEST_FIT_DECREASING](window, Budget(8), PackedTokens(), True)
    assert _ids(r) == [[0, 1, 2]] and r.leftovers == []
