"""The progress record of one epoch: its fields, written once here (the codec, the
checks and the cross-rank claim derive theirs from them), and the split of the
epoch's order that it implies. See the package docstring for what they mean."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import filterfalse
from typing import Any

from odb_core.errors import ConfigError, ResumeStateError
from odb_core.ledger import Ledgers


def partition(order: Sequence[int], world: int, rank: int) -> list[int]:
    """Round-robin split of `order` over `world` ranks: every id on exactly one rank,
    no padding duplicates, shard sizes differ by at most one."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank={rank!r} is not in [0, {world!r})")
    return list(order[rank::world])


@dataclass(frozen=True)
class ProgressRecord:
    """How far one epoch got, as plain values. `EpochProgress` (the class callers
    use) adds the codec and the checks; they live in modules of their own, which
    import this record and not the class that calls them."""

    fingerprint: Mapping[str, Any]
    epoch: int
    step: int
    emitted: int
    closed: bool
    base_done: frozenset[int]
    world_size: int | None = None
    rank: int | None = None
    done: frozenset[int] = frozenset()
    carry: Ledgers = ()
    window: int = 0
    start_step: int = 0
    start_emitted: int = 0
    start_window: int = 0

    @property
    def is_global(self) -> bool:
        return self.rank is None

    def excluded(self, world: int, rank: int) -> frozenset[int]:
        """Ids rank `rank` of `world` must not emit again; raises if this record
        cannot resume that rank."""
        if self.is_global:
            return self.base_done
        if world != self.world_size or rank != self.rank:
            raise ResumeStateError(
                f"this loader state belongs to rank {self.rank} of world size "
                f"{self.world_size}, but it is loaded on rank {rank} of world size {world}; "
                "to resume at another world size or rank, load the list of every rank's "
                "state_dict() taken at the same step (they are merged with merge_states)"
            )
        # No copy of a 500k-id set when one side is empty (the common case).
        if not self.done:
            return self.base_done
        return self.base_done | self.done if self.base_done else self.done

    def shard(self, order: Sequence[int], world: int, rank: int) -> list[int]:
        """This rank's remaining ids of a map-style epoch, in epoch order."""
        excluded = self.excluded(world, rank)
        rest = list(filterfalse(self.base_done.__contains__, order)) if self.base_done else order
        part = partition(rest, world, rank)
        return list(filterfalse(excluded.__contains__, part)) if excluded else part


# The record's fields in declaration order: the state's fields between its
# "format"/"version" header and its checksum.
RECORD_FIELDS = tuple(f.name for f in fields(ProgressRecord))
# The non-negative integer fields (the codec's `_int`, the claim's scalars).
COUNTS = tuple(f.name for f in fields(ProgressRecord) if f.type in ("int", int))
# What only the rank that saved a state holds; the fingerprint is compared apart.
OWN = ("world_size", "rank", "done")
# Fields every rank's state of one step holds alike.
SHARED = tuple(name for name in RECORD_FIELDS if name not in (*OWN, "fingerprint"))
