"""The pure decision behind the cross-rank id check (odb_core.identity), without
torch: which ids repeat, on which ranks, and the exact error every rank raises.
The collective around it is tested on gloo ranks in tests/test_cross_rank_ids.py."""

from __future__ import annotations

import pytest

from odb_core.errors import DuplicateIdError
from odb_core.identity import check_unique, find_repeats


def test_no_repeats_in_disjoint_or_empty_lists() -> None:
    assert find_repeats([]) == []
    assert find_repeats([[], []]) == []
    assert find_repeats([[3, 1], [2], [0, 4]]) == []
    check_unique([[3, 1], [2], [0, 4]])
    check_unique([])


def test_repeats_list_every_holder_in_rank_order_smallest_id_first() -> None:
    # generators are accepted and read once
    per_rank = [iter([9, 2, 5]), iter([2, 7]), iter([5, 5, 9])]
    assert find_repeats(per_rank) == [(2, (0, 1)), (5, (0, 2, 2)), (9, (0, 2))]


def test_an_id_held_twice_by_one_rank_names_that_rank() -> None:
    with pytest.raises(DuplicateIdError) as err:
        check_unique([[1], [4, 4]])
    assert str(err.value) == (
        "sample id 4 was emitted or owned twice by rank 1 in one epoch (1 ids repeat): "
        "sample ids must be unique across ranks; an id_fn that maps two samples to one id, "
        "or samplers whose shards overlap, make the same id appear on two ranks"
    )
    assert (err.value.sample_id, err.value.ranks) == (4, (1, 1))


def test_the_error_names_the_first_id_its_ranks_and_up_to_five_more() -> None:
    per_rank = [list(range(10)), list(range(10)), [0]]
    with pytest.raises(DuplicateIdError) as err:
        check_unique(per_rank, what="held")
    assert str(err.value).startswith(
        "sample id 0 was held by ranks 0, 1, 2 in one epoch (10 ids repeat; also "
        "1 (ranks [0, 1]); 2 (ranks [0, 1]); 3 (ranks [0, 1]); 4 (ranks [0, 1]); "
        "5 (ranks [0, 1])): sample ids must be unique"
    )
    assert "6 (ranks" not in str(err.value)
    assert (err.value.sample_id, err.value.ranks) == (0, (0, 1, 2))


def test_a_rank_holding_an_id_twice_beside_another_rank_is_listed_twice() -> None:
    with pytest.raises(
        DuplicateIdError, match=r"^sample id 7 was emitted or owned by ranks 0, 2, 2 "
    ) as err:
        check_unique([[7], [1], [7, 7]])
    assert err.value.ranks == (0, 2, 2)
