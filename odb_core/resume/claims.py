"""The cross-rank check of a resume: what each rank loaded, as a vector of
integers for one collective at the first iteration after a load (`ResumeClaim`),
and the check every rank runs alike over every rank's claim (`check_claims`)."""

from __future__ import annotations

import array
import hashlib
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

from odb_core.errors import ResumeMismatchError
from odb_core.identity import check_unique
from odb_core.resume.codec import _preview
from odb_core.resume.record import COUNTS, SHARED, ProgressRecord

_NONE, _LOADED, _REFUSED = 0, 1, 2
_CLAIM = 0x0DB5  # marks a claim vector
# The shared counts and flags, sent as they are; then whether the state is merged,
# its world size, and base_done (count, digest), carry and fingerprint as digests.
_SCALARS = tuple(name for name in SHARED if name in COUNTS or name == "closed")
_CLAIM_FIELDS = (*_SCALARS, "merged", "world_size", "base_done", "carry", "fingerprint")


@dataclass(frozen=True)
class ResumeClaim:
    """What one rank loaded, as a vector of integers for the one collective at the
    first iteration after a load (`check_claims`): the fields every rank must hold
    alike (the id sets and the fingerprint as digests), and this rank's done ids."""

    status: int
    shared: tuple[int, ...] = ()  # in _CLAIM_FIELDS order; base_done as (len, digest)
    done: tuple[int, ...] = ()

    @staticmethod
    def of(progress: ProgressRecord | None, *, refused: bool = False) -> ResumeClaim:
        if progress is None:
            return ResumeClaim(_REFUSED if refused else _NONE)
        p = progress
        shared = (
            *(int(getattr(p, name)) for name in _SCALARS),
            int(p.is_global),
            -1 if p.world_size is None else p.world_size,
            len(p.base_done),
            _ids_digest(sorted(p.base_done)),
            _digest([list(part) for part in p.carry]),
            _digest(dict(p.fingerprint)),
        )
        return ResumeClaim(_LOADED, shared, tuple(sorted(p.done)))

    def to_vector(self) -> list[int]:
        return [_CLAIM, self.status, len(self.shared), *self.shared, *self.done]

    @staticmethod
    def from_vector(v: Sequence[int], rank: int) -> ResumeClaim:
        if len(v) < 3 or v[0] != _CLAIM or len(v) < 3 + v[2]:
            raise ResumeMismatchError(
                f"rank {rank} sent a malformed resume claim {_preview(list(v))}",
                field="claim",
                ranks=(rank,),
            )
        n = v[2]
        return ResumeClaim(v[1], tuple(v[3 : 3 + n]), tuple(v[3 + n :]))

    def field(self, name: str) -> object:
        i = _CLAIM_FIELDS.index(name)
        if name == "base_done":
            return (self.shared[i], self.shared[i + 1])
        return self.shared[i if i < _CLAIM_FIELDS.index("base_done") else i + 1]


def check_claims(vectors: Sequence[Sequence[int]], rank: int) -> str:
    """The cross-rank check of a resume, run alike on every rank over every rank's
    claim: every rank loaded a state, or none did; the states hold the same step,
    epoch, counts, base_done, carry and fingerprint; no id is done on two ranks; and
    the done ids of all ranks account for exactly the samples emitted. Raises
    `ResumeMismatchError` naming the field and the ranks (`DuplicateIdError` for an
    id done on two ranks); returns a digest of the merged progress."""
    claims = [ResumeClaim.from_vector(v, r) for r, v in enumerate(vectors)]
    statuses = {c.status for c in claims}
    if len(statuses) > 1:
        groups = {s: [r for r, c in enumerate(claims) if c.status == s] for s in statuses}
        words = {
            _LOADED: "loaded a state",
            _NONE: "loaded none (or set_epoch discarded it)",
            _REFUSED: "refused theirs in load_state_dict",
        }
        told = "; ".join(f"ranks {groups[s]} {words.get(s, s)}" for s in sorted(groups))
        raise ResumeMismatchError(
            f"rank {rank}: the ranks did not all resume: {told}. Every rank must load its "
            "state of the same step before iterating",
            field="loaded",
            ranks=tuple(r for s in sorted(groups) if s != _LOADED for r in groups[s]),
        )
    if statuses != {_LOADED}:
        return ""
    for name in _CLAIM_FIELDS:
        values = [c.field(name) for c in claims]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {_show(name, v)}" for r, v in enumerate(values))
            raise ResumeMismatchError(
                f"rank {rank}: the ranks loaded states with different {name} ({shown}): "
                "every rank must load its own state taken at the same step of the same run; "
                "nothing was applied",
                field=name,
                ranks=_outliers(values),
            )
    if len(claims) > 1:  # one rank's done ids come from a set
        check_unique([c.done for c in claims], what="done (in the loaded states)")
    first = claims[0]
    at = _CLAIM_FIELDS.index  # fields up to base_done's count sit at their index
    if not first.shared[at("merged")]:
        emitted, base = first.shared[at("emitted")], first.shared[at("base_done")]
        _check_count(emitted, base, [(r, len(c.done)) for r, c in enumerate(claims)])
    union = sorted(chain.from_iterable(c.done for c in claims))  # sorted runs: a merge
    return _hex(hashlib.sha256(_packed([*first.shared, -1, *union])).digest())


def _outliers(values: Sequence[object]) -> tuple[int, ...]:
    """The ranks not holding the value most ranks hold (every rank on a tie)."""
    counts = Counter(values)
    (top, n), *rest = counts.most_common()
    if rest and rest[0][1] == n:
        return tuple(range(len(values)))
    return tuple(r for r, v in enumerate(values) if v != top)


def _check_count(emitted: int, base: int, done: Sequence[tuple[int, int]]) -> None:
    """The done ids of all ranks plus base_done are exactly the samples emitted."""
    total = base + sum(n for _, n in done)
    if total == emitted:
        return
    parts = " + ".join(f"rank {r}: {n}" for r, n in done)
    effect = (
        f"{emitted - total} emitted samples are missing from done and would be emitted again"
        if total < emitted
        else f"{total - emitted} ids never emitted are marked done and would be lost"
    )
    raise ResumeMismatchError(
        f"the states' done ids (base_done {base} + {parts} = {total}) do not account for "
        f"emitted={emitted}: {effect}; nothing was applied",
        field="done",
        ranks=tuple(r for r, _ in done),
    )


def _digest(value: object) -> int:
    raw = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big") >> 1


def _ids_digest(ids: Sequence[int]) -> int:
    return int.from_bytes(hashlib.sha256(_packed(ids)).digest()[:8], "big") >> 1


def _packed(values: Sequence[int]) -> bytes:
    """`values` as bytes, in C: little-endian 8-byte integers (what the collectives
    carry), or decimal text when one does not fit."""
    try:
        raw = array.array("q", values)
    except OverflowError:
        return b"t" + ",".join(map(str, values)).encode()
    if sys.byteorder == "big":
        raw.byteswap()
    return b"q" + raw.tobytes()


def _hex(raw: bytes) -> str:
    return raw.hex()[:16]


def _show(name: str, v: object) -> str:
    if name == "base_done" and isinstance(v, tuple):
        return f"{v[0]} ids (digest {v[1]:016x})"
    if name in ("carry", "fingerprint") and isinstance(v, int):
        return f"digest {v:016x}"
    return repr(v)
