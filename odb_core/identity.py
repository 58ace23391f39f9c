"""Sample ids unique across ranks: the pure decision behind the check at an epoch's close.

A rank's own bookkeeping (the machine's per-rank duplicate check) sees only its
own ids; an `id_fn` that maps samples on two ranks to one id, or samplers whose
shards overlap, go unnoticed there. At the close of an epoch every rank sends
the ids it *holds* for the epoch and every rank runs `find_repeats` on the same
gathered lists, so every rank reaches the same verdict. What a rank holds: the
ids it emitted, the ids its source delivered that it skipped as done before a
resume, and (quota mode) its ledger of ids not emitted. What this guarantees is
stated in proofs/identity_uniqueness.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from odb_core.errors import DuplicateIdError

__all__ = ["check_unique", "find_repeats"]


def find_repeats(per_rank: Sequence[Iterable[int]]) -> list[tuple[int, tuple[int, ...]]]:
    """Every id held more than once, with the ranks that hold it (a rank that holds
    it twice is listed twice), smallest id first."""
    lists = [list(ids) for ids in per_rank]
    flat = [i for ids in lists for i in ids]
    if len(set(flat)) == len(flat):
        return []  # the common case, in one pass over a set
    repeated = {i for i, n in Counter(flat).items() if n > 1}
    holders: dict[int, list[int]] = {}
    for rank, ids in enumerate(lists):
        for i in ids:
            if i in repeated:
                holders.setdefault(i, []).append(rank)
    return sorted((i, tuple(rs)) for i, rs in holders.items())


def check_unique(per_rank: Sequence[Iterable[int]], *, what: str = "emitted or owned") -> None:
    """Raise `DuplicateIdError` naming the first repeated id and its ranks."""
    repeats = find_repeats(per_rank)
    if not repeats:
        return
    sid, ranks = repeats[0]
    where = (
        f"twice by rank {ranks[0]}"
        if len(set(ranks)) == 1
        else "by ranks " + ", ".join(map(str, ranks))
    )
    more = "; ".join(f"{i} (ranks {list(rs)})" for i, rs in repeats[1:6])
    raise DuplicateIdError(
        f"sample id {sid} was {what} {where} in one epoch ({len(repeats)} ids repeat"
        + (f"; also {more}" if more else "")
        + "): sample ids must be unique across ranks; an id_fn that maps two samples to "
        "one id, or samplers whose shards overlap, make the same id appear on two ranks",
        sample_id=sid,
        ranks=ranks,
    )
