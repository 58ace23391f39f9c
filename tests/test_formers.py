"""Batch formers: partition contract, budget safety, oversize handling."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core.cost import AttentionAware, BatchStats, Budget, CostModel, PackedTokens, PaddedTokens
from odb_core.formers import FORMERS, FormerKind, sort_window_greedy
from odb_core.sample import Sample

MODELS: list[CostModel] = [PackedTokens(), PaddedTokens(), AttentionAware(alpha=0.01)]

windows = st.lists(
    st.tuples(st.integers(1, 60), st.integers(0, 20), st.integers(0, 3)), min_size=0, max_size=40
).map(lambda xs: [Sample(i, t, v, p) for i, (t, v, p) in enumerate(xs)])


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
    result = FORMERS[kind](window, b, model, flush)
    out = [s for batch in result.batches for s in batch.samples] + result.leftovers
    # Partition: nothing lost, nothing duplicated.
    assert Counter(out) == Counter(window)
    if flush:
        assert result.leftovers == []
    if window:
        assert result.batches, "a non-empty window always yields a batch"
    for batch in result.batches:
        assert batch.samples
        fits = b.fits(BatchStats.of(batch.samples), model)
        # Budget safety: over budget only as a flagged solo batch.
        assert fits or (len(batch.samples) == 1 and batch.oversize)
        assert batch.oversize == (not fits)


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
