"""A cost table learned online: what each sample cost when a rank last preprocessed it.

Dynamic sharding deals ids before anyone knows what they cost (`odb_core.assign`):
the deal prices an unseen id at the gathered mean. During an epoch each rank records
the cost it observed for every id it preprocessed (`RankMachine.observed`); at the
epoch's close the ranks exchange them once, as one byte per dataset id (`encode`: a
log-scale code, 12 steps per octave, so a decoded cost is within 3% of the observed
one; 0 means never seen), combined by a bytewise maximum (each id was observed by one
rank). From the next epoch on the deal prices each id by the table (`price`), the
mean for ids never seen, and the initial shares are placed by it (`CostTable.placed`).
10M ids take 10 MB.

Pricing decides only where an id goes, never which ids are dealt or whether one is
trained: the deal's counts are a function of agreed state whatever the table holds
(proofs/dynamic_sharding.md, "Pricing"), so the table may be stale, noisy (costs vary
between epochs with augmentation) or adversarial without touching D1-D3.
"""

from __future__ import annotations

import base64
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from odb_core.assign import initial_cursor, priced_shares
from odb_core.errors import ResumeStateError

UNSEEN = 0
"""The code of an id no rank has observed."""
STEPS_PER_OCTAVE = 12
MAX_CODE = 255


def encode(cost: int) -> int:
    """The 1-byte code of an observed cost (>= 0): 1 + round(12 log2(cost + 1)),
    at most 255 (costs above 2^21 tokens share the top code)."""
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 0:
        raise ValueError(f"cost {cost!r} is not a non-negative integer")
    return min(MAX_CODE, 1 + round(STEPS_PER_OCTAVE * math.log2(cost + 1)))


def decode(code: int) -> int:
    """The cost a code stands for (the inverse of `encode` up to rounding)."""
    if code == UNSEEN:
        raise ValueError("code 0 stands for an unseen id, which has no cost")
    return round(2 ** ((code - 1) / STEPS_PER_OCTAVE)) - 1


_DECODED = (0, *(decode(c) for c in range(1, MAX_CODE + 1)))


def record(observed: Mapping[int, int], size: int) -> bytearray:
    """One rank's table of the epoch: `size` codes (one per id 0..size-1), the code of
    what it observed at each id it preprocessed, 0 elsewhere. Ids outside the range
    are not recorded (they are not dataset indices)."""
    codes = bytearray(size)
    for i, cost in observed.items():
        if 0 <= i < size:
            codes[i] = encode(cost)
    return codes


def combine(tables: Iterable[bytes | bytearray]) -> bytes:
    """The ranks' tables as one: the bytewise maximum (what an all-reduce with MAX
    returns); each id was observed by at most one rank, so this is its code."""
    out: bytearray | None = None
    for t in tables:
        if out is None:
            out = bytearray(t)
        elif len(t) != len(out):
            raise ValueError(f"tables of {len(out)} and {len(t)} ids cannot be combined")
        else:
            out = bytearray(map(max, out, t))
    return bytes(out or b"")


class CostTable:
    """The agreed table of one epoch: a code per dataset id (immutable)."""

    __slots__ = ("_codes", "_placed", "_prefix")

    def __init__(self, codes: bytes) -> None:
        if not isinstance(codes, (bytes, bytearray)):
            raise TypeError(f"codes must be bytes, got {type(codes).__name__}")
        self._codes = bytes(codes)
        self._prefix: tuple[Sequence[int], tuple[list[int], list[int]]] | None = None
        self._placed: tuple[Any, ...] = ()

    def __len__(self) -> int:
        return len(self._codes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CostTable) and other._codes == self._codes

    def __hash__(self) -> int:
        return hash(self._codes)

    def __repr__(self) -> str:
        return f"CostTable({len(self)} ids, {self.seen} seen)"

    @property
    def codes(self) -> bytes:
        return self._codes

    @property
    def seen(self) -> int:
        return len(self._codes) - self._codes.count(UNSEEN)

    def price(self, i: int) -> int | None:
        """The cost id `i` is priced at, None when never seen (or not a table id)."""
        if 0 <= i < len(self._codes):
            c = self._codes[i]
            return None if c == UNSEEN else _DECODED[c]
        return None

    def plan_prefix(self, plan: Sequence[int]) -> tuple[list[int], list[int]]:
        """Prefix sums over `plan`'s positions: the priced cost of the known ids, and
        the count of unseen ones (kept for the last plan asked: every rank of a
        simulation shares the epoch's plan)."""
        cached = self._prefix
        if cached is not None and cached[0] is plan:
            return cached[1]
        known, unseen = [0], [0]
        k = u = 0
        codes, dec = self._codes, _DECODED
        n = len(codes)
        for i in plan:
            c = codes[i] if 0 <= i < n else UNSEEN
            if c == UNSEEN:
                u += 1
            else:
                k += dec[c]
            known.append(k)
            unseen.append(u)
        self._prefix = (plan, (known, unseen))
        return known, unseen

    def priced_prefix(self, plan: Sequence[int]) -> Callable[[int], int]:
        """`priced(k)`: the priced cost of `plan`'s first k ids, those never seen priced
        at the mean of the seen ones (>= 1; 1 when none is), as the deals price them
        (`RankMachine.pricing`). What `assign.initial_slices` splits the plan by."""
        known, unseen = self.plan_prefix(plan)
        seen = len(plan) - unseen[-1]
        mean = max(1, known[-1] // seen) if seen else 1

        def priced(k: int) -> int:
            return known[k] + mean * unseen[k]

        return priced

    def placed(
        self, plan: tuple[int, ...], world: int, target: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The plan with its initial prefix placed, and the ranks' share sizes: the
        prefix `assign.initial_cursor(..., priced=True)` reordered so that each rank's
        share (`assign.priced_shares` by this table's prices, unseen ids at the mean of
        the seen ones, as `priced_prefix`) is one run, in rank order; the rest of the
        plan as it was. The same ids are dealt up front whatever the prices, and a
        placed plan places to itself (`ProtocolConfig` places every plan it is given
        with a table, so a config built from a placed plan is the same config). Kept
        for the last plan asked: every rank of a simulation shares the epoch's plan."""
        key = (world, target)
        cached = self._placed
        if cached and cached[2] == key and (plan is cached[0] or plan is cached[1]):
            return cached[1], cached[3]
        c = initial_cursor(len(plan), world, target, priced=True)
        known, unseen = self.plan_prefix(plan)
        seen = len(plan) - unseen[-1]
        mean = max(1, known[-1] // seen) if seen else 1
        codes, dec, n = self._codes, _DECODED, len(self._codes)
        head = plan[:c]
        prices = []
        for i in head:
            code = codes[i] if 0 <= i < n else UNSEEN
            prices.append(mean if code == UNSEEN else dec[code])
        shares = priced_shares(prices, head, world)
        out = (*(head[k] for share in shares for k in share), *plan[c:])
        sizes = tuple(len(share) for share in shares)
        if out == plan:
            out = plan
        self._placed = (plan, out, key, sizes)
        return out, sizes

    def to_state(self) -> dict[str, Any]:
        """Plain data for a loader state: the codes, compressed, and their checksum."""
        return {
            "ids": len(self._codes),
            "codes": base64.b64encode(zlib.compress(self._codes, 6)).decode("ascii"),
            "crc32": zlib.crc32(self._codes),
        }

    @classmethod
    def from_state(cls, state: object, size: int | None = None) -> CostTable:
        """The table a loader state holds; raises ResumeStateError naming what is wrong
        (state from disk is untrusted). `size`: the dataset's length, when known."""
        if not isinstance(state, Mapping) or set(state) != {"ids", "codes", "crc32"}:
            raise ResumeStateError(
                f"loader state field cost_table={_preview(state)} must be a mapping with "
                "keys ids, codes, crc32"
            )
        ids, text, crc = state["ids"], state["codes"], state["crc32"]
        if isinstance(ids, bool) or not isinstance(ids, int) or ids < 0:
            raise ResumeStateError(f"loader state field cost_table.ids={ids!r} is not a count")
        if size is not None and ids != size:
            raise ResumeStateError(
                f"loader state field cost_table.ids={ids} but the dataset has {size} ids"
            )
        if not isinstance(text, str):
            raise ResumeStateError("loader state field cost_table.codes is not a string")
        try:
            # A bounded decompression: a table of `ids` codes is `ids` bytes.
            d = zlib.decompressobj()
            codes = d.decompress(base64.b64decode(text, validate=True), ids + 1)
        except (ValueError, zlib.error) as exc:
            raise ResumeStateError(
                f"loader state field cost_table.codes is corrupt: {exc}"
            ) from None
        if len(codes) != ids or not d.eof:
            raise ResumeStateError(
                f"loader state field cost_table.codes holds {len(codes)}"
                f"{'' if d.eof else '+'} codes, not ids={ids}"
            )
        if isinstance(crc, bool) or not isinstance(crc, int) or zlib.crc32(codes) != crc:
            raise ResumeStateError(
                f"loader state field cost_table.crc32={crc!r} does not match its codes"
            )
        return cls(codes)


def _preview(x: object) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."
