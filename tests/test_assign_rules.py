"""The arithmetic of `odb_core.assign.deal`, case by case: which counts and costs
the deal reads, how it prices unread ids, and when it falls back to counting
samples. Each case is small enough to follow by hand (the comments do), and
each pins a rule that a wrong sign, a dropped term or a swapped branch breaks
(the surviving mutants of `make mutants` on odb_core/assign.py, docs/VERIFICATION.md).
"""

from __future__ import annotations

from odb_core.assign import deal
from odb_core.collective import Contribution


def _c(
    *batches: tuple[int, int],
    unread: int = 0,
    held: int = 0,
    work: int = 0,
    final: bool = False,
) -> Contribution:
    """A contribution offering `batches` as (samples, cost tokens) pairs."""
    samples = tuple(n for n, _ in batches)
    tokens = tuple(t for _, t in batches)
    return Contribution(len(batches), final, samples, tokens, samples, unread, held, work)


def test_unread_ids_count_toward_the_target() -> None:
    # One held sample and two unread ids: the rank holds 3 of its target 4.
    assert deal([_c((1, 10), unread=2, held=1, work=5)], steps=1, plan_left=10, target=4) == (1,)


def test_batches_offered_beyond_the_steps_are_held_work_in_full() -> None:
    # steps=0: both ranks keep what they offered. Rank 0 holds two samples of 10
    # tokens (work 20), rank 1 one batch of 2 samples and 15 tokens (work 15):
    # 4 held samples, 35 tokens; the one id goes to the lighter rank 1.
    got = deal([_c((1, 10), (1, 10)), _c((2, 15))], steps=0, plan_left=1, target=3)
    assert got == (0, 1)


def test_only_the_batches_past_the_steps_price_the_mean() -> None:
    # steps=1: rank 0's first batch (5 samples, 50 tokens) and rank 1's (3, 30)
    # are stepped and gone. Held: rank 0 one sample of 10 tokens, rank 1 one of 40.
    # Mean 25 a sample; scaled by the 2 held samples: rank 0 at 20, rank 1 at 80,
    # each new id +50. The 4 ids: rank 0 (70), rank 0 (120), rank 1 (130), rank 0.
    got = deal([_c((5, 50), (1, 10)), _c((3, 30), held=1, work=40)], 1, 4, 3)
    assert got == (3, 1)


def test_held_samples_of_no_cost_are_dealt_by_count() -> None:
    # Two held samples of 0 tokens: the mean cost is 0, so the deal counts samples
    # and alternates; it must not give every id to rank 0.
    got = deal([_c((1, 0), held=1), _c((1, 0), held=1)], steps=1, plan_left=4, target=3)
    assert got == (2, 2)


def test_counting_deals_one_id_at_a_time_to_the_emptiest_rank() -> None:
    # Nothing held: rank 0 holds 0 samples, rank 1 one unread id. Two ids: rank 0
    # gets one (now 1), ties with rank 1 and, as the lower rank, gets the other.
    got = deal([_c((1, 3)), _c((1, 3), unread=1)], steps=1, plan_left=2, target=3)
    assert got == (2, 0)


def test_counting_includes_the_id_a_starved_rank_already_got() -> None:
    # Rank 0 offered nothing: it is starved and gets an id first (holds 1), so the
    # round runs no step (steps=0; the deal cap does not apply). Rank 1 holds its
    # offered batch (1 sample) and its unread id: 2. The ranks lack 3 + 2 = 5 ids
    # (not 6: rank 0's first id counts); priced at the mean (1), rank 0 (est 1)
    # takes two, then the tie goes to rank 0: 4 and 2.
    got = deal([_c(), _c((1, 1), unread=1)], steps=0, plan_left=10, target=4)
    assert got == (4, 2)


def test_unread_ids_are_priced_at_the_mean_cost() -> None:
    # Two held samples of 10 tokens each, one per rank: mean 10. Rank 1 also has two
    # unread ids, priced at the mean: 30 against rank 0's 10 (times the 2 held
    # samples: 60 against 20, each new id +20), so both ids go to rank 0.
    got = deal([_c((1, 10), held=1, work=10), _c((1, 10), unread=2, held=1, work=10)], 1, 2, 4)
    assert got == (2, 0)


def test_the_id_a_starved_rank_got_is_priced_like_an_unread_one() -> None:
    # Rank 0 is starved (offered nothing; the round runs no step) with one held
    # sample of 10 tokens; rank 1 holds its offered batch of one 10-token sample.
    # Mean 10: rank 0's first id is priced at it, 20 against rank 1's 20 (scaled by
    # the 3 held samples: 60 and 60, +30 an id). The 4 ids the ranks lack alternate
    # from the tie, rank 0 first: 3 and 2 (unpriced, rank 0 would take 3 more).
    got = deal([_c(held=1, work=10), _c((1, 10), held=1, work=10)], 0, 10, 4)
    assert got == (3, 2)
