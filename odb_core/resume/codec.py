"""A progress record as plain data and back: the schema of a state (its header,
the record's fields, a checksum), canonical JSON for that checksum, and the strict
parse of a state from disk, which is untrusted input."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from odb_core.errors import ConfigError, ResumeStateError
from odb_core.idset import decode, encode
from odb_core.ledger import validate_ledgers
from odb_core.resume.record import COUNTS, RECORD_FIELDS, ProgressRecord

STATE_VERSION = 4
# 2: optimizer windows and exact resume (window, start_step, start_emitted, start_window).
# 3: a sha256 checksum of the content; a strict schema (every field, no other, unique ids).
# 4: base_done and done as canonical id ranges (odb_core.idset), not lists of ids.
_FORMAT = "odb_core.epoch_progress"
FIELDS = ("format", "version", *RECORD_FIELDS, "checksum")

# How a field other than a count or a null-or-count is written and read back.
_WRITE: dict[str, Callable[[Any], object]] = {
    "fingerprint": dict,
    "base_done": encode,
    "done": encode,
    "carry": lambda carry: [list(part) for part in carry],
}


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


def write(record: ProgressRecord) -> dict[str, Any]:
    """The sealed plain-data state of `record`."""
    body: dict[str, Any] = {"format": _FORMAT, "version": STATE_VERSION}
    for name in RECORD_FIELDS:
        value = getattr(record, name)
        body[name] = _WRITE[name](value) if name in _WRITE else value
    return seal(body)


def read(d: object) -> dict[str, Any]:
    """The record's fields of a state: plain data of this version's schema whose
    checksum matches its content. Raises `ResumeStateError` naming the field."""
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
    fields: dict[str, Any] = {name: _int(d, name) for name in COUNTS}
    fields.update(
        fingerprint=dict(d["fingerprint"]),
        closed=d["closed"],
        base_done=decode(d["base_done"], "base_done"),
        world_size=world,
        rank=rank,
        done=decode(d["done"], "done"),
        carry=carry,
    )
    return fields


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
