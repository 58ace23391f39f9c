"""The compact form of the id sets in a resume state, whichever is shorter:

- sorted half-open ranges `[[start, stop], ...]` (start < stop, each range ending
  strictly before the next one starts): a few ranges when ids are done in runs;
- `"bitmap:<base64>"`: bit j of byte k set for id 8k + j, no trailing zero byte:
  at most one bit per id up to the largest, when ids are scattered (a shuffled
  epoch: 1M ids in 167 kB).

Every set has exactly one form of each kind. Pure; decoding is strict because a
state from disk is untrusted input."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from itertools import compress

from odb_core.errors import ResumeStateError

_BITMAP = "bitmap:"
_BIT = [bytes(b >> j & 1 for b in range(256)) for j in range(8)]  # byte -> its bit j


def encode(ids: Iterable[int]) -> list[list[int]] | str:
    """The shorter of the canonical ranges and the canonical bitmap of `ids`."""
    ranges = ranges_of(ids)
    if len(ranges) < 4 or ranges[0][0] < 0:  # id_fn ids may be negative: ranges only
        return ranges
    top = ranges[-1][1]
    bitmap_len = len(_BITMAP) + 4 * -(-((top + 7) // 8) // 3)
    if bitmap_len >= 8 * len(ranges):  # a range costs at least ~8 bytes of JSON
        return ranges
    bits = bytearray((top + 7) // 8)
    for start, stop in ranges:
        for i in range(start, stop):
            bits[i >> 3] |= 1 << (i & 7)
    return _BITMAP + base64.b64encode(bytes(bits)).decode()


def ranges_of(ids: Iterable[int]) -> list[list[int]]:
    """The canonical ranges of `ids`."""
    out: list[list[int]] = []
    for i in sorted(ids):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def decode(v: object, field: str, limit: int | None = None) -> frozenset[int]:
    """The ids of canonical ranges `v`; `ResumeStateError` naming `field` and the
    offending value unless `v` is a list of [start, stop] integer pairs with
    start < stop, in increasing order, neither overlapping nor touching, and (with
    `limit`) 0 <= start and stop <= limit; or a canonical `bitmap:` string."""
    if isinstance(v, str) and v.startswith(_BITMAP):
        return _decode_bitmap(v, field)
    if not isinstance(v, (list, tuple)):
        raise ResumeStateError(
            f"loader state field {field} must be a list of [start, stop] id ranges, "
            f"got {type(v).__name__}"
        )
    out: set[int] = set()
    prev: int | None = None
    for k, r in enumerate(v):
        if (
            not isinstance(r, (list, tuple))
            or len(r) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in r)
        ):
            raise ResumeStateError(
                f"loader state field {field}[{k}]={r!r} is not a [start, stop] pair of integers"
            )
        start, stop = r
        if stop <= start:
            raise ResumeStateError(
                f"loader state field {field}[{k}]={[start, stop]} is not a range start < stop"
            )
        if prev is not None and start <= prev:
            raise ResumeStateError(
                f"loader state field {field}[{k}]={[start, stop]} overlaps, touches or "
                f"precedes the range before it (which ends at {prev}): ranges must be "
                "increasing and apart"
            )
        if limit is not None and (start < 0 or stop > limit):
            raise ResumeStateError(
                f"loader state field {field}[{k}]={[start, stop]} holds ids outside [0, {limit})"
            )
        out.update(range(start, stop))
        prev = stop
    return frozenset(out)


def _decode_bitmap(v: str, field: str) -> frozenset[int]:
    raw = v[len(_BITMAP) :]
    try:
        bits = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise ResumeStateError(
            f"loader state field {field}={v[:40]!r}... is not valid base64 after 'bitmap:'"
        ) from None
    if base64.b64encode(bits).decode() != raw:
        raise ResumeStateError(f"loader state field {field}: its bitmap is not canonical base64")
    if not bits or bits[-1] == 0:
        raise ResumeStateError(
            f"loader state field {field}: its bitmap is empty or ends with a zero byte "
            "(not the canonical form state_dict() writes)"
        )
    # One byte per id: bit j of every byte (bytes.translate) lands at every 8th byte
    # from j (a slice assignment), then the ids whose byte is set (itertools.compress),
    # all in C; building the frozenset in id order is the only pass per id.
    flags = bytearray(len(bits) << 3)
    for j in range(8):
        flags[j::8] = bits.translate(_BIT[j])
    return frozenset(compress(range(len(flags)), flags))
