"""odb_core.idset: the compact id sets of a resume state read back exactly, and
every malformed form is refused naming the field and the value."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core.errors import ResumeStateError
from odb_core.idset import decode, encode, ranges_of


@settings(max_examples=300, deadline=None)
@given(st.frozensets(st.integers(-50, 5000), max_size=400))
def test_encode_then_decode_is_the_identity(ids: frozenset[int]) -> None:
    assert decode(encode(ids), "done") == ids


def test_runs_are_ranges_and_scattered_ids_a_bitmap_much_smaller_than_a_list() -> None:
    assert encode(range(10, 500_010)) == [[10, 500_010]]
    assert ranges_of({1, 2, 3, 7}) == [[1, 4], [7, 8]]
    scattered = encode(range(0, 200_000, 2))
    assert isinstance(scattered, str) and scattered.startswith("bitmap:")
    assert len(scattered) < 40_000  # 25 kB of bits, base64: not 100k ids
    assert decode(scattered, "done") == frozenset(range(0, 200_000, 2))


def bitmap(raw: bytes) -> str:
    return "bitmap:" + base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("bitmap:@@@", "loader state field done='bitmap:@@@'... is not valid base64"),
        (bitmap(b"\x05\x00"), "its bitmap is empty or ends with a zero byte"),
        (bitmap(b""), "its bitmap is empty or ends with a zero byte"),
        ("bitmap:BQ", "is not valid base64"),
        ("0-5", "must be a list of [start, stop] id ranges, got str"),
        ([[0, 3], [3, 5]], "done[1]=[3, 5] overlaps, touches or precedes"),
        ([[4, 2]], "done[0]=[4, 2] is not a range start < stop"),
        ([[0, 2, 3]], "done[0]=[0, 2, 3] is not a [start, stop] pair"),
    ],
)
def test_malformed_sets_are_refused_naming_the_value(value: object, text: str) -> None:
    with pytest.raises(ResumeStateError) as err:
        decode(value, "done")
    assert text in str(err.value)


def test_ids_beyond_a_limit_are_refused_naming_the_range() -> None:
    with pytest.raises(ResumeStateError, match=r"done\[1\]=\[8, 11\] holds ids outside \[0, 10\)"):
        decode([[0, 2], [8, 11]], "done", limit=10)
    with pytest.raises(ResumeStateError, match=r"done\[0\]=\[-1, 2\] holds ids outside"):
        decode([[-1, 2]], "done", limit=10)
    assert decode([[-3, -1]], "done") == {-3, -2}  # id_fn ids may be negative
    assert decode([[0, 2], [8, 10]], "done", limit=10) == {0, 1, 8, 9}
