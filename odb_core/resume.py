"""Resumable epoch progress: which sample ids are done, and which rank owns the rest.

Pure and plain-data. A rank knows the ids it has emitted itself; the ids other
ranks emitted never cross the wire (the round's all-gather carries counts only).
So a progress record has two parts:

- `base_done`: ids done before the current incarnation of the epoch began,
  identical on every rank (empty at the start of an epoch);
- `done`: ids this rank emitted since then (a *local* record), or nothing
  (a *global* record, made by `merge` from the records of every rank at one step).

A rank's shard in an incarnation is a pure function of (epoch order, world size,
rank, base_done) minus its own `done`, so a local record resumes its own rank at
the same world size, and a global record resumes any world size: every id of the
epoch is emitted exactly once across the checkpoint.

The protocol run that emits an incarnation's steps began at step `start_step`
(with `start_emitted` global samples emitted and `start_window` optimizer
windows closed before it): 0 at the start of an epoch, the saved step after a
merged (any world size) or non-deterministic resume. A deterministic loader
resumes a local record exactly by replaying that run from its start; `window`
is the window index the next step opens when a fresh run starts at `step`.
Every one of these is the same on every rank.

`carry` (quota mode, see `odb_core.ledger`) is the pending per-rank ledger, the
same on every rank: while the epoch runs, the ledger it started with (part of its
plan, re-dealt less `base_done` in a new incarnation); once it has closed, its
own ledger, which the next epoch starts with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from odb_core.errors import ConfigError
from odb_core.ledger import Ledgers, validate_ledgers

STATE_VERSION = 2
# 2: optimizer windows and exact resume (window, start_step, start_emitted, start_window).
_FORMAT = "odb_core.epoch_progress"


def partition(order: Sequence[int], world: int, rank: int) -> list[int]:
    """Round-robin split of `order` over `world` ranks: every id on exactly one rank,
    no padding duplicates, shard sizes differ by at most one."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank={rank!r} is not in [0, {world!r})")
    return list(order[rank::world])


def fingerprint_mismatch(expected: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """Keys whose values differ, as readable `key: saved=... now=...` lines."""
    keys = sorted(set(expected) | set(got))
    return [
        f"{k}: saved={got.get(k)!r} now={expected.get(k)!r}"
        for k in keys
        if expected.get(k) != got.get(k)
    ]


@dataclass(frozen=True)
class EpochProgress:
    """How far one epoch got; see the module docstring."""

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
            raise ConfigError(
                f"this loader state belongs to rank {self.rank} of world size "
                f"{self.world_size}, but it is loaded on rank {rank} of world size {world}; "
                "to resume at another world size or rank, load the list of every rank's "
                "state_dict() taken at the same step (they are merged with merge_states)"
            )
        return self.base_done | self.done

    def shard(self, order: Sequence[int], world: int, rank: int) -> list[int]:
        """This rank's remaining ids of a map-style epoch, in epoch order."""
        excluded = self.excluded(world, rank)
        rest = [i for i in order if i not in self.base_done]
        return [i for i in partition(rest, world, rank) if i not in excluded]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": STATE_VERSION,
            "fingerprint": dict(self.fingerprint),
            "epoch": self.epoch,
            "step": self.step,
            "emitted": self.emitted,
            "closed": self.closed,
            "base_done": sorted(self.base_done),
            "world_size": self.world_size,
            "rank": self.rank,
            "done": sorted(self.done),
            "carry": [list(part) for part in self.carry],
            "window": self.window,
            "start_step": self.start_step,
            "start_emitted": self.start_emitted,
            "start_window": self.start_window,
        }

    @staticmethod
    def from_dict(d: object) -> EpochProgress:
        if not isinstance(d, Mapping) or d.get("format") != _FORMAT:
            raise ConfigError(
                f"not an ODBDataLoader state (expected format {_FORMAT!r}): {_preview(d)}"
            )
        if d.get("version") != STATE_VERSION:
            older = isinstance(d.get("version"), int) and d["version"] < STATE_VERSION
            raise ConfigError(
                f"loader state version {d.get('version')!r}, expected {STATE_VERSION}"
                + (
                    ": it was saved by an older odb-core, before optimizer windows and exact "
                    "resume, and cannot be resumed by this one (restart the epoch)"
                    if older
                    else ""
                )
            )
        try:
            world, rank = d["world_size"], d["rank"]
            return EpochProgress(
                fingerprint=dict(d["fingerprint"]),
                epoch=_int(d, "epoch"),
                step=_int(d, "step"),
                emitted=_int(d, "emitted"),
                closed=bool(d["closed"]),
                base_done=_ids(d, "base_done"),
                world_size=None if world is None else _int(d, "world_size"),
                rank=None if rank is None else _int(d, "rank"),
                done=_ids(d, "done"),
                carry=validate_ledgers(d.get("carry", ())),
                window=_int(d, "window"),
                start_step=_int(d, "start_step"),
                start_emitted=_int(d, "start_emitted"),
                start_window=_int(d, "start_window"),
            )
        except KeyError as exc:
            raise ConfigError(f"loader state is missing the field {exc.args[0]!r}") from None


def merge(states: Iterable[EpochProgress]) -> EpochProgress:
    """One global record from the local records of every rank, taken at the same step."""
    parts = sorted(states, key=lambda s: -1 if s.rank is None else s.rank)
    if not parts:
        raise ConfigError("merge needs the state of every rank, got none")
    if len(parts) == 1 and parts[0].is_global:
        return parts[0]
    first = parts[0]
    if any(p.is_global for p in parts):
        raise ConfigError("cannot merge a merged (global) loader state with per-rank states")
    world = first.world_size
    ranks = [p.rank for p in parts]
    if any(p.world_size != world for p in parts) or ranks != list(range(world or 0)):
        raise ConfigError(
            f"merge needs exactly one state per rank of one run; got ranks {ranks} for "
            f"world sizes {sorted({p.world_size for p in parts}, key=str)}"
        )
    for p in parts[1:]:
        diff = fingerprint_mismatch(first.fingerprint, p.fingerprint)
        if diff:
            raise ConfigError(f"rank {p.rank} state is from another config: " + "; ".join(diff))
        for name in (
            "epoch",
            "step",
            "emitted",
            "closed",
            "base_done",
            "carry",
            "window",
            "start_step",
            "start_emitted",
            "start_window",
        ):
            if getattr(p, name) != getattr(first, name):
                raise ConfigError(
                    f"rank {p.rank} state has {name}={_preview(getattr(p, name))} but rank "
                    f"{first.rank} has {_preview(getattr(first, name))}: states must be taken "
                    "at the same step of the same epoch"
                )
    done: set[int] = set(first.base_done)
    for p in parts:
        clash = done & p.done
        if clash:
            raise ConfigError(f"ids {sorted(clash)[:10]} are done on two ranks; states corrupt")
        done |= p.done
    # The merged record starts a new protocol run at the saved step.
    return EpochProgress(
        first.fingerprint,
        first.epoch,
        first.step,
        first.emitted,
        first.closed,
        frozenset(done),
        carry=first.carry,
        window=first.window,
        start_step=first.step,
        start_emitted=first.emitted,
        start_window=first.window,
    )


def _int(d: Mapping[str, Any], key: str) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"loader state field {key}={v!r} must be a non-negative integer")
    return v


def _ids(d: Mapping[str, Any], key: str) -> frozenset[int]:
    v = d[key]
    if not isinstance(v, (list, tuple)) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in v
    ):
        raise ConfigError(f"loader state field {key} must be a list of integer ids")
    return frozenset(v)


def _preview(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
