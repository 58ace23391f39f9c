"""Quota-mode carry-over: how the samples an epoch did not emit enter the next one.

Pure and plain-data (no torch, no I/O); the adapter moves the ledgers between
ranks with one all-gather at the end of a quota-mode epoch and calls these.

The ledger of epoch e is every sample id of e's plan that was not emitted: each
rank's part is the window and ready batches it carried at the close plus the ids
its source never delivered. After the exchange every rank holds the same
per-rank ledgers. Epoch e+1's source order on rank r is

    share(r) + [i for i in partition(r) if i not in ledger]

where `partition(r)` is e+1's normal per-rank split and `share(r)` is rank r's
share of the ledger: the round-robin split of the ledgers concatenated in rank
order (balanced, so no rank starts the epoch with all the carried work), or,
with `keep_on_rank` (a rank's data is its own shard, so an id means something
only on the rank that produced it), rank r's own ledger. Since the shares are
disjoint and every ledger id is removed from every partition, each id is in at
most one rank's order, once: the core's one-id-once-per-epoch rule holds. A
carried id comes before any id of the new epoch on its rank, so it is observed
first; whatever the new epoch still does not emit is carried again.

The core forms carried ids ahead of fresh ones (`ProtocolConfig.carried`,
`formers.carried_first`), so a carried id is emitted by the next pass under the
hypotheses of proofs/cross_epoch_fairness.md. `ages` reports, per carried id,
how many passes in a row it has been carried (1: only by the last one); the
theorem bounds it by 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from odb_core.errors import ConfigError

Ledgers = tuple[tuple[int, ...], ...]


def _ids(values: object, what: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigError(f"{what} must be a sequence of integer sample ids, got {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{what} holds {v!r}, which is not an integer sample id")
    return tuple(values)


def validate_ledgers(ledgers: object) -> Ledgers:
    """Per-rank ledgers as tuples; raises ConfigError naming the offending value
    (a non-integer id, or an id in two places: an id is emitted at most once per
    epoch, so it can be missing from at most one rank)."""
    if isinstance(ledgers, (str, bytes)) or not isinstance(ledgers, Sequence):
        raise ConfigError(f"ledgers must be a sequence of per-rank id lists, got {ledgers!r}")
    out = tuple(_ids(part, f"ledger of rank {r}") for r, part in enumerate(ledgers))
    seen: dict[int, int] = {}
    for r, part in enumerate(out):
        for i in part:
            if i in seen:
                where = "twice" if seen[i] == r else f"on ranks {seen[i]} and {r}"
                raise ConfigError(f"sample id {i!r} is in the ledger {where}")
            seen[i] = r
    return out


def ledger_ids(ledgers: Ledgers) -> tuple[int, ...]:
    """Every carried id, in rank order (the order shares are dealt in)."""
    return tuple(i for part in ledgers for i in part)


def share(ledgers: Ledgers, world: int, rank: int, *, keep_on_rank: bool = False) -> list[int]:
    """Rank `rank`'s share of the ledger in an epoch of `world` ranks."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"world={world!r} must be a positive integer")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ConfigError(f"rank={rank!r} is not in [0, {world})")
    if keep_on_rank:
        if not any(ledgers):
            return []
        if len(ledgers) != world:
            raise ConfigError(
                f"the ledger holds {len(ledgers)} ranks' carried ids but the epoch runs on "
                f"{world} ranks; with each rank's own shard (partition=False) carried ids "
                "cannot move to another rank"
            )
        return list(ledgers[rank])
    return list(ledger_ids(ledgers)[rank::world])


def rank_order(
    ledgers: Ledgers,
    partition: Sequence[int],
    world: int,
    rank: int,
    *,
    keep_on_rank: bool = False,
) -> list[int]:
    """Rank `rank`'s source order for the next epoch: its ledger share, then its
    normal partition without any ledger id."""
    ledgers = validate_ledgers(ledgers)
    part = _ids(partition, f"partition of rank {rank}")
    seen: set[int] = set()
    for i in part:
        if i in seen:
            raise ConfigError(f"partition of rank {rank} holds sample id {i!r} twice")
        seen.add(i)
    carried = set(ledger_ids(ledgers))
    head = share(ledgers, world, rank, keep_on_rank=keep_on_rank)
    return head + [i for i in part if i not in carried]


def plan_epoch(
    ledgers: Sequence[Sequence[int]],
    partitions: Sequence[Sequence[int]],
    *,
    keep_on_rank: bool = False,
) -> list[list[int]]:
    """Every rank's source order for the next epoch (`partitions[r]` is rank r's
    normal split); raises ConfigError if the partitions overlap."""
    checked = validate_ledgers(ledgers)
    world = len(partitions)
    owner: dict[int, int] = {}
    for r, part in enumerate(partitions):
        for i in _ids(part, f"partition of rank {r}"):
            if i in owner:
                raise ConfigError(
                    f"sample id {i!r} is in the partitions of ranks {owner[i]} and {r}"
                )
            owner[i] = r
    return [
        rank_order(checked, part, world, r, keep_on_rank=keep_on_rank)
        for r, part in enumerate(partitions)
    ]


def without(ledgers: Ledgers, done: frozenset[int] | set[int]) -> Ledgers:
    """The ledgers less ids already emitted (a resumed epoch's earlier incarnation)."""
    if not done:
        return ledgers
    return tuple(tuple(i for i in part if i not in done) for part in ledgers)


def ages(ledgers: Ledgers, before: Mapping[int, int] | None = None) -> dict[int, int]:
    """Each id of `ledgers` (what a pass did not emit) with its age: the passes in
    a row it has been carried out of. `before` holds the ages of the ids that
    pass started with; an id it emitted drops out, one it carried again ages."""
    prev = before or {}
    return {i: prev.get(i, 0) + 1 for i in ledger_ids(ledgers)}
