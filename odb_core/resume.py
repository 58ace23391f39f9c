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

import array
import hashlib
import json
import math
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, filterfalse
from typing import Any

from odb_core.errors import ConfigError, ResumeMismatchError, ResumeStateError
from odb_core.identity import check_unique
from odb_core.idset import decode, encode
from odb_core.ledger import Ledgers, ledger_ids, rank_order, validate_ledgers, without

STATE_VERSION = 4
# 2: optimizer windows and exact resume (window, start_step, start_emitted, start_window).
# 3: a sha256 checksum of the content; a strict schema (every field, no other, unique ids).
# 4: base_done and done as canonical id ranges (odb_core.idset), not lists of ids.
_FORMAT = "odb_core.epoch_progress"
FIELDS = (
    "format",
    "version",
    "fingerprint",
    "epoch",
    "step",
    "emitted",
    "closed",
    "base_done",
    "world_size",
    "rank",
    "done",
    "carry",
    "window",
    "start_step",
    "start_emitted",
    "start_window",
    "checksum",
)


def canonical(state: Mapping[str, Any]) -> bytes:
    """The state less its checksum, as canonical JSON (sorted keys, no spaces)."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    return json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def checksum(state: Mapping[str, Any]) -> str:
    """`sha256:<hex>` of `canonical(state)`."""
    return "sha256:" + hashlib.sha256(canonical(state)).hexdigest()


def seal(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `state` with its checksum recomputed. Only for tests that derive one
    state from another (no adapter edits loader state: a prefetching trainer asks
    `ODBDataLoader.state_after(step)`); it makes an edited state pass the checksum,
    not the consistency checks."""
    out = dict(state)
    out["checksum"] = checksum(out)
    return out


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

    def to_dict(self) -> dict[str, Any]:
        return seal(
            {
                "format": _FORMAT,
                "version": STATE_VERSION,
                "fingerprint": dict(self.fingerprint),
                "epoch": self.epoch,
                "step": self.step,
                "emitted": self.emitted,
                "closed": self.closed,
                "base_done": encode(self.base_done),
                "world_size": self.world_size,
                "rank": self.rank,
                "done": encode(self.done),
                "carry": [list(part) for part in self.carry],
                "window": self.window,
                "start_step": self.start_step,
                "start_emitted": self.start_emitted,
                "start_window": self.start_window,
            }
        )

    @staticmethod
    def from_dict(d: object) -> EpochProgress:
        """Parse and check a state: plain data of this version's schema whose checksum
        matches its content, and whose fields are consistent with each other (see
        `check`). Raises `ResumeStateError` naming the field."""
        if not isinstance(d, Mapping) or d.get("format") != _FORMAT:
            raise ResumeStateError(
                f"not an ODBDataLoader state (expected format {_FORMAT!r}): {_preview(d)}"
            )
        version = d.get("version")
        if isinstance(version, bool) or version != STATE_VERSION:
            older = isinstance(version, int) and version < STATE_VERSION
            raise ResumeStateError(
                f"loader state version {version!r}, expected {STATE_VERSION}"
                + (
                    ": it was saved by an older odb-core (version 3 lists done ids one by "
                    "one, older ones carry no checksum or no optimizer windows) and cannot be "
                    "resumed by this one (restart the epoch, or resume with the odb-core "
                    "that saved it)"
                    if older
                    else ""
                )
            )
        if "checksum" not in d:
            raise ResumeStateError(
                "loader state has no checksum field: it was not written by state_dict() "
                "(or the field was stripped), so its content cannot be trusted"
            )
        missing = [k for k in FIELDS if k not in d]
        if missing:
            raise ResumeStateError(
                f"loader state is missing the field{'s' if len(missing) > 1 else ''} "
                + ", ".join(map(repr, missing))
            )
        unknown = sorted((k for k in d if k not in FIELDS), key=repr)
        if unknown:
            raise ResumeStateError(
                f"loader state has unknown field(s) {', '.join(map(repr, unknown))}: not a "
                f"state of version {STATE_VERSION}"
            )
        for key in FIELDS:
            _plain(d[key], key)
        saved = d["checksum"]
        if not isinstance(saved, str) or not saved.startswith("sha256:"):
            raise ResumeStateError(f"loader state checksum {_preview(saved)} is not sha256:<hex>")
        actual = checksum(d)
        if saved != actual:
            raise ResumeStateError(
                f"loader state checksum mismatch: it records {saved[:23]}... but its content "
                f"hashes to {actual[:23]}...: the state changed after state_dict() wrote it "
                "(storage corruption, or an edit)"
            )
        if not isinstance(d["fingerprint"], Mapping):
            raise ResumeStateError(
                f"loader state field fingerprint={_preview(d['fingerprint'])} must be a mapping"
            )
        if not isinstance(d["closed"], bool):
            raise ResumeStateError(f"loader state field closed={d['closed']!r} must be a bool")
        if (d["world_size"] is None) != (d["rank"] is None):
            raise ResumeStateError(
                f"loader state has world_size={d['world_size']!r} and rank={d['rank']!r}: "
                "both must be set (one rank's state) or both null (a merged state)"
            )
        world: int | None = None
        rank: int | None = None
        if d["world_size"] is not None:
            world, rank = _int(d, "world_size"), _int(d, "rank")
            if world < 1 or rank >= world:
                raise ResumeStateError(
                    f"loader state field rank={rank} is not in [0, world_size={world})"
                )
        try:
            carry = validate_ledgers(d["carry"])
        except ConfigError as exc:
            raise ResumeStateError(f"loader state field carry: {exc}") from None
        progress = EpochProgress(
            fingerprint=dict(d["fingerprint"]),
            epoch=_int(d, "epoch"),
            step=_int(d, "step"),
            emitted=_int(d, "emitted"),
            closed=d["closed"],
            base_done=decode(d["base_done"], "base_done"),
            world_size=world,
            rank=rank,
            done=decode(d["done"], "done"),
            carry=carry,
            window=_int(d, "window"),
            start_step=_int(d, "start_step"),
            start_emitted=_int(d, "start_emitted"),
            start_window=_int(d, "start_window"),
        )
        progress.check()
        return progress

    def check(self) -> None:
        """Raise `ResumeStateError` unless the fields are consistent with each other:
        what every state the loader writes satisfies, whatever the dataset."""
        both = self.base_done & self.done
        if both:
            raise ResumeStateError(
                f"loader state: id {min(both)} is in both base_done and done ({len(both)} such ids)"
            )
        for lo, hi in (
            ("start_step", "step"),
            ("start_emitted", "emitted"),
            ("start_window", "window"),
            ("start_window", "start_step"),
            ("window", "step"),
        ):
            if getattr(self, lo) > getattr(self, hi):
                raise ResumeStateError(
                    f"loader state has {lo}={getattr(self, lo)} > {hi}={getattr(self, hi)}: "
                    "impossible in a state the loader wrote (a run starts before it ends, "
                    "and a window holds at least one step)"
                )
        # Every aligned step has at least one real sample on some rank.
        if self.emitted - self.start_emitted < self.step - self.start_step:
            raise ResumeStateError(
                f"loader state has {self.step - self.start_step} steps since step "
                f"{self.start_step} but only {self.emitted - self.start_emitted} samples "
                "emitted in them: every step emits at least one sample"
            )
        if len(self.base_done) > self.start_emitted:
            raise ResumeStateError(
                f"loader state has {len(self.base_done)} base_done ids but only "
                f"start_emitted={self.start_emitted} samples were emitted before this run"
            )
        if len(self.base_done) + len(self.done) > self.emitted:
            raise ResumeStateError(
                f"loader state marks {len(self.base_done) + len(self.done)} ids done but "
                f"emitted={self.emitted}: ids never emitted are marked done (they would be "
                "lost)"
            )
        if self.is_global:
            run = (self.start_step, self.start_emitted, self.start_window)
            if (
                self.done
                or run != (self.step, self.emitted, self.window)
                or len(self.base_done) != self.emitted
            ):
                raise ResumeStateError(
                    "loader state is a merged (all-rank) state but its fields are not those "
                    "merge_states writes: done must be empty, start_step/start_emitted/"
                    "start_window equal to step/emitted/window, and base_done hold exactly "
                    f"emitted={self.emitted} ids (it holds {len(self.base_done)})"
                )

    def check_for(self, target: ResumeTarget) -> list[int] | None:
        """Raise `ResumeStateError` unless this state can be the progress of the
        loader described by `target` (its dataset, split and windows). Returns this
        rank's remaining ids, `shard(target.order, ...)`, when the check computed
        them on the way (a local state with done ids and no carry), else None."""
        t = target
        self.excluded(t.world, t.rank)  # a local state resumes only its own rank
        if t.steps_per_window is not None:
            g = t.steps_per_window
            if (
                self.start_step > self.start_window * g
                or self.step - self.start_step > (self.window - self.start_window) * g
            ):
                raise ResumeStateError(
                    f"loader state has step={self.step} (run from step {self.start_step}) "
                    f"but window={self.window} (from {self.start_window}): with {g} step(s) "
                    "per optimizer window the step and window counts disagree"
                )
        if t.id_limit is not None:
            for name, ids in (
                ("base_done", self.base_done),
                ("done", self.done),
                ("carry", frozenset(ledger_ids(self.carry))),
            ):
                if ids and (min(ids) < 0 or max(ids) >= t.id_limit):
                    bad = min(ids) if min(ids) < 0 else max(ids)
                    raise ResumeStateError(
                        f"loader state field {name} holds id {bad}, which is not an "
                        f"index of this dataset (0..{t.id_limit - 1})"
                    )
        remaining: list[int] | None = None
        if t.order is not None and self.done and not self.is_global:
            base = self.base_done
            rest = list(filterfalse(base.__contains__, t.order)) if base else t.order
            part = partition(rest, t.world, t.rank)
            carry = without(self.carry, base)
            if any(carry):
                foreign = self.done.difference(rank_order(carry, part, t.world, t.rank))
            else:
                # part is a slice of a permutation (distinct ids), so done is a subset
                # of it exactly when dropping done from it drops len(done) ids: one
                # pass that yields this rank's shard, and no set of a million ids.
                remaining = list(filterfalse(self.done.__contains__, part))
                foreign = (
                    self.done.difference(part)
                    if len(part) - len(remaining) != len(self.done)
                    else frozenset()
                )
            if foreign:
                raise ResumeStateError(
                    f"loader state of rank {t.rank}: done id {min(foreign)} is not one of "
                    f"this rank's samples in this part of the epoch ({len(foreign)} such ids)"
                )
        if t.size is not None:
            carried = len(ledger_ids(self.carry)) if self.closed and not t.join else 0
            if self.emitted + carried > t.size:
                raise ResumeStateError(
                    f"loader state has emitted={self.emitted}"
                    + (f" and {carried} carried" if carried else "")
                    + f" but the epoch has {t.size} samples"
                )
            if self.closed and self.emitted + carried != t.size:
                raise ResumeStateError(
                    f"loader state is closed=true but emitted={self.emitted}"
                    + (f" + {carried} carried" if carried else "")
                    + f" of the epoch's {t.size} samples: an epoch closes only once every "
                    "sample is emitted"
                    + (" or carried" if not t.join else "")
                    + f" ({t.size - self.emitted - carried} would be lost)"
                )
        return remaining


@dataclass(frozen=True)
class ResumeReport:
    """What a `load_state_dict` resumed from: the epoch and step of the state, the
    global samples emitted before it (`samples_done`), whether that epoch had
    closed, and the world size it was saved at and the one it resumes at. Steps a
    failed run trained after this state are trained again (the replay since the
    checkpoint: at most the checkpoint interval)."""

    epoch: int
    step: int
    samples_done: int
    closed: bool
    saved_world_size: int | None
    world_size: int

    @staticmethod
    def of(progress: EpochProgress, world_size: int) -> ResumeReport:
        return ResumeReport(
            epoch=progress.epoch,
            step=progress.step,
            samples_done=progress.emitted,
            closed=progress.closed,
            saved_world_size=progress.world_size,
            world_size=world_size,
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ResumeTarget:
    """What a loader knows of the epoch a state must belong to (`check_for`).

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


def merge(states: Iterable[EpochProgress]) -> EpochProgress:
    """One global record from the local records of every rank, taken at the same step."""
    parts = sorted(states, key=lambda s: -1 if s.rank is None else s.rank)
    if not parts:
        raise ResumeStateError("merge needs the state of every rank, got none")
    if len(parts) == 1 and parts[0].is_global:
        return parts[0]
    first = parts[0]
    if any(p.is_global for p in parts):
        raise ResumeStateError("cannot merge a merged (global) loader state with per-rank states")
    world = first.world_size
    ranks = [p.rank for p in parts]
    if any(p.world_size != world for p in parts) or ranks != list(range(world or 0)):
        raise ResumeStateError(
            f"merge needs exactly one state per rank of one run; got ranks {ranks} for "
            f"world sizes {sorted({p.world_size for p in parts}, key=str)}"
        )
    for p in parts[1:]:
        diff = fingerprint_mismatch(first.fingerprint, p.fingerprint)
        if diff:
            raise ResumeStateError(
                f"rank {p.rank} state is from another config: " + "; ".join(diff)
            )
        for name in SHARED:
            if getattr(p, name) != getattr(first, name):
                raise ResumeMismatchError(
                    f"rank {p.rank} state has {name}={_preview(getattr(p, name))} but rank "
                    f"{first.rank} has {_preview(getattr(first, name))}: states must be taken "
                    "at the same step of the same epoch",
                    field=name,
                    ranks=(first.rank or 0, p.rank or 0),
                )
    done: set[int] = set(first.base_done)
    for p in parts:
        clash = done & p.done
        if clash:
            raise ResumeStateError(
                f"ids {sorted(clash)[:10]} are done on two ranks; states corrupt"
            )
        done |= p.done
    _check_count(first.emitted, len(first.base_done), [(p.rank or 0, len(p.done)) for p in parts])
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


# Fields every rank's state of one step holds alike.
SHARED = (
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
)

_NONE, _LOADED, _REFUSED = 0, 1, 2
_CLAIM = 0x0DB5  # marks a claim vector
_CLAIM_FIELDS = (
    "epoch",
    "step",
    "emitted",
    "closed",
    "window",
    "start_step",
    "start_emitted",
    "start_window",
    "merged",
    "world_size",
    "base_done",
    "carry",
    "fingerprint",
)


@dataclass(frozen=True)
class ResumeClaim:
    """What one rank loaded, as a vector of integers for the one collective at the
    first iteration after a load (`check_claims`): the fields every rank must hold
    alike (the id sets and the fingerprint as digests), and this rank's done ids."""

    status: int
    shared: tuple[int, ...] = ()  # in _CLAIM_FIELDS order; base_done as (len, digest)
    done: tuple[int, ...] = ()

    @staticmethod
    def of(progress: EpochProgress | None, *, refused: bool = False) -> ResumeClaim:
        if progress is None:
            return ResumeClaim(_REFUSED if refused else _NONE)
        p = progress
        shared = (
            p.epoch,
            p.step,
            p.emitted,
            int(p.closed),
            p.window,
            p.start_step,
            p.start_emitted,
            p.start_window,
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
    emitted, merged, base = first.shared[2], first.shared[8], first.shared[10]
    if not merged:
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


def _plain(v: object, path: str) -> None:
    """Raise unless `v` is JSON-shaped plain data (finite floats, string keys)."""
    if v is None or isinstance(v, (bool, int, str)):
        return
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ResumeStateError(f"loader state field {path}={v!r} is not a finite number")
        return
    if isinstance(v, (list, tuple)):
        for j, x in enumerate(v):
            _plain(x, f"{path}[{j}]")
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ResumeStateError(f"loader state field {path} has the non-string key {k!r}")
            _plain(x, f"{path}.{k}")
        return
    raise ResumeStateError(
        f"loader state field {path} holds a {type(v).__name__} ({_preview(v)}), not plain "
        "data (JSON types: dict, list, str, int, float, bool, None)"
    )


def _int(d: Mapping[str, Any], key: str) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ResumeStateError(f"loader state field {key}={v!r} must be a non-negative integer")
    return v


def _preview(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
