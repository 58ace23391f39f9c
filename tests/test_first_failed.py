"""A peer error names the rank that failed first, ahead of the ranks that only
relay its failure (transport._first_failed, PeerBoard failure notes)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from odb_core.torch.transport import _first_failed, _parse_note


def test_a_relaying_rank_comes_after_the_rank_it_names() -> None:
    faults = {0: ((2,), "ODBPeerError: rank 2 died"), 2: ((), "SampleLoadError: boom")}
    assert _first_failed(faults, me=1) == (2, 0)


def test_a_killed_root_without_a_note_is_named_first() -> None:
    faults = {0: ((3,), "ODBPeerError: rank 3 died"), 1: ((3,), "ODBPeerError: rank 3 died")}
    assert _first_failed(faults, me=2) == (3, 0, 1)


def test_independent_failures_in_rank_order() -> None:
    assert _first_failed({2: ((), "a"), 1: ((), "b")}, me=0) == (1, 2)


def test_a_peer_that_gave_up_on_the_reader_is_named_not_the_reader() -> None:
    assert _first_failed({1: ((0,), "ODBPeerError: rank 0 hung")}, me=0) == (1,)


def test_notes_round_trip_and_a_foreign_note_is_its_own_message() -> None:
    assert _parse_note('{"relayed": [2], "message": "x"}') == ((2,), "x")
    assert _parse_note("plain text") == ((), "plain text")
