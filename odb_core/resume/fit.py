"""The fit of a progress record to the loader that loads it: this dataset, split,
seed and optimizer windows (`ResumeTarget`), and the fingerprint of its config."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import filterfalse
from typing import Any

from odb_core.errors import ResumeStateError
from odb_core.ledger import ledger_ids, rank_order, without
from odb_core.resume.record import ProgressRecord, partition


@dataclass(frozen=True)
class ResumeTarget:
    """What a loader knows of the epoch a state must belong to (`check_fit`).

    `id_limit`: ids are dataset indices below it. `order`: the epoch's order of
    indices, split by `partition` (given only when the loader splits it itself and
    ids are indices). `size`: samples in the epoch over all ranks (the map-style
    epoch split across ranks). `steps_per_window`: G when windows close every G
    steps. `join`: join mode (else quota)."""

    world: int
    rank: int
    join: bool = True
    id_limit: int | None = None
    order: Sequence[int] | None = None
    size: int | None = None
    steps_per_window: int | None = None


def fingerprint_mismatch(expected: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """Keys whose values differ, as readable `key: saved=... now=...` lines."""
    keys = sorted(set(expected) | set(got))
    return [
        f"{k}: saved={got.get(k)!r} now={expected.get(k)!r}"
        for k in keys
        if expected.get(k) != got.get(k)
    ]


def check_fit(p: ProgressRecord, t: ResumeTarget) -> list[int] | None:
    """Raise `ResumeStateError` unless `p` can be the progress of the loader described
    by `t` (its dataset, split and windows). Returns this rank's remaining ids,
    `p.shard(t.order, ...)`, when the check computed them on the way (a local state
    with done ids and no carry), else None."""
    p.excluded(t.world, t.rank)  # a local state resumes only its own rank
    if t.steps_per_window is not None:
        g = t.steps_per_window
        if (
            p.start_step > p.start_window * g
            or p.step - p.start_step > (p.window - p.start_window) * g
        ):
            raise ResumeStateError(
                f"loader state has step={p.step} (run from step {p.start_step}) "
                f"but window={p.window} (from {p.start_window}): with {g} step(s) "
                "per optimizer window the step and window counts disagree"
            )
    if t.id_limit is not None:
        for name, ids in (
            ("base_done", p.base_done),
            ("done", p.done),
            ("carry", frozenset(ledger_ids(p.carry))),
        ):
            if ids and (min(ids) < 0 or max(ids) >= t.id_limit):
                bad = min(ids) if min(ids) < 0 else max(ids)
                raise ResumeStateError(
                    f"loader state field {name} holds id {bad}, which is not an "
                    f"index of this dataset (0..{t.id_limit - 1})"
                )
    remaining: list[int] | None = None
    if t.order is not None and p.done and not p.is_global:
        base = p.base_done
        rest = list(filterfalse(base.__contains__, t.order)) if base else t.order
        part = partition(rest, t.world, t.rank)
        carry = without(p.carry, base)
        if any(carry):
            foreign = p.done.difference(rank_order(carry, part, t.world, t.rank))
        else:
            # part is a slice of a permutation (distinct ids), so done is a subset
            # of it exactly when dropping done from it drops len(done) ids: one
            # pass that yields this rank's shard, and no set of a million ids.
            remaining = list(filterfalse(p.done.__contains__, part))
            foreign = (
                p.done.difference(part)
                if len(part) - len(remaining) != len(p.done)
                else frozenset()
            )
        if foreign:
            raise ResumeStateError(
                f"loader state of rank {t.rank}: done id {min(foreign)} is not one of "
                f"this rank's samples in this part of the epoch ({len(foreign)} such ids)"
            )
    if t.size is not None:
        carried = len(ledger_ids(p.carry)) if p.closed and not t.join else 0
        if p.emitted + carried > t.size:
            raise ResumeStateError(
                f"loader state has emitted={p.emitted}"
                + (f" and {carried} carried" if carried else "")
                + f" but the epoch has {t.size} samples"
            )
        if p.closed and p.emitted + carried != t.size:
            raise ResumeStateError(
                f"loader state is closed=true but emitted={p.emitted}"
                + (f" + {carried} carried" if carried else "")
                + f" of the epoch's {t.size} samples: an epoch closes only once every "
                "sample is emitted"
                + (" or carried" if not t.join else "")
                + f" ({t.size - p.emitted - carried} would be lost)"
            )
    return remaining
