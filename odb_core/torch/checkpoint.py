"""Every rank's loader state in one checkpoint entry, the one format all trainer
adapters save (HF Trainer, Accelerate, Lightning):

    {"format": "odb-loader-states", "version": 1, "world_size": W, "ranks": [state_0, ...]}

`gather_states(loader)` builds it (a collective on a gloo group of its own: call it
on every rank, in the same order); `load_states(loader, entry)` checks it and
resumes the loader: this rank's own state at the same world size, every rank's
merged at another. The entry comes from disk, so it is untrusted: its shape is
checked here and every state by `load_state_dict` (schema, checksum, dataset and
config, consistency, and across ranks at the first iteration) before anything
is applied. The two formats the adapters wrote before (Accelerate's
`odb-accelerate-loader`, Lightning's `odb-lightning-datamodule`) are read too.
`write_states(folder, entry)` / `read_states(folder)` keep the entry in a
checkpoint folder (`odb_loader_states.json`) for a trainer that saves folders
(`write_json` / `read_json` for a trainer's own file beside it).
"""

from __future__ import annotations

import datetime
import json
import os
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from odb_core.errors import ODBPeerError, ResumeStateError

if TYPE_CHECKING:
    from odb_core.torch.loader import ODBDataLoader

STATES_FORMAT = "odb-loader-states"
STATES_VERSION = 1
#: Earlier adapter formats (version 1 each) and the key of their list of states.
LEGACY_FORMATS = {"odb-accelerate-loader": "ranks", "odb-lightning-datamodule": "loader_states"}

_groups: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def gather_states(loader: ODBDataLoader, local: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every rank's `local` state (default: `loader.state_dict()`; a trainer that
    prefetches passes `loader.state_after(step in training)`) in the one checkpoint
    format. A collective over the loader's ranks, on a gloo group of its own (the
    protocol thread may be in a round on the loader's group)."""
    state = dict(loader.state_dict() if local is None else local)
    world = loader.world_size
    states: list[Any] = [state]
    if world > 1:
        group = _groups.get(loader)
        if group is None:
            timeout = datetime.timedelta(seconds=float(loader.transport_timeout) or 300.0)
            group = _groups[loader] = dist.new_group(backend="gloo", timeout=timeout)
        states = [None] * world
        try:
            dist.all_gather_object(states, state, group=group)
        except RuntimeError as exc:
            raise ODBPeerError(
                "gathering every rank's loader state for a checkpoint failed: the checkpoint "
                "must be saved on every rank"
            ) from exc
    return {
        "format": STATES_FORMAT,
        "version": STATES_VERSION,
        "world_size": world,
        "ranks": states,
    }


def states_of(entry: Any) -> list[Mapping[str, Any]]:
    """The per-rank states of a checkpoint entry, its shape checked
    (`ResumeStateError` names what is wrong)."""
    if not isinstance(entry, Mapping):
        raise ResumeStateError(
            f"an ODB loader checkpoint entry is a mapping in the {STATES_FORMAT!r} format, "
            f"got {type(entry).__name__}"
        )
    fmt = entry.get("format")
    key = "ranks" if fmt == STATES_FORMAT else LEGACY_FORMATS.get(str(fmt))
    if key is None:
        raise ResumeStateError(
            f"checkpoint entry format {fmt!r} is not an ODB loader state format "
            f"({STATES_FORMAT!r}, or the older {sorted(LEGACY_FORMATS)}): was it saved by "
            "another object registered in the same position?"
        )
    if entry.get("version") != STATES_VERSION:
        raise ResumeStateError(
            f"{fmt!r} version {entry.get('version')!r}; this odb-core reads version "
            f"{STATES_VERSION}"
        )
    states = entry.get(key)
    if (
        not isinstance(states, Sequence)
        or isinstance(states, (str, bytes))
        or not states
        or not all(isinstance(s, Mapping) for s in states)
    ):
        raise ResumeStateError(f"{fmt!r}: {key!r} is not a non-empty list of loader states")
    world = entry.get("world_size", len(states))
    if world != len(states):
        raise ResumeStateError(f"{fmt!r}: world_size={world!r} but {len(states)} rank states")
    return list(states)


def load_states(loader: ODBDataLoader, entry: Any) -> None:
    """Resume `loader` from `gather_states`' entry: this rank's state at the same world
    size under static sharding or on one rank, else the merge of every rank's (at
    another world size, and under dynamic sharding, which resumes only merged);
    checked before it is applied."""
    states = states_of(entry)
    own = not loader.config.dynamic or loader.world_size == 1
    if len(states) == loader.world_size and own:
        loader.load_state_dict(states[loader.rank])
    else:
        loader.load_state_dict(states)


#: The file a checkpoint folder holds the entry in (HF Trainer's checkpoint folders).
STATES_FILE = "odb_loader_states.json"
_RANK_FILES = "odb_loader_rank*.json"  # a file per rank, before one format: read once


def write_json(folder: str | os.PathLike[str], name: str, data: Any) -> Path:
    """Write `data` as JSON to `folder/name` atomically (a reader sees the old file
    or the new one); returns the file. A trainer's own sidecar uses it too."""
    path = Path(folder, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return path


def read_json(folder: str | os.PathLike[str], name: str) -> Any:
    """What `write_json` wrote to `folder/name`; None when there is no such file."""
    path = Path(folder, name)
    return json.loads(path.read_text()) if path.exists() else None


def write_states(folder: str | os.PathLike[str], entry: Mapping[str, Any]) -> Path:
    """Write `gather_states`' entry into `folder` (atomically); returns the file."""
    return write_json(folder, STATES_FILE, entry)


def read_states(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The entry `write_states` wrote into `folder` (or the per-rank files odb-core
    wrote before one format, as one entry); None when the folder has neither."""
    entry: dict[str, Any] | None = read_json(folder, STATES_FILE)
    if entry is not None:
        return entry
    path = Path(folder)
    files = sorted(path.glob(_RANK_FILES))
    if not files:
        return None
    ranks = {int(f.stem.rsplit("rank", 1)[1]): json.loads(f.read_text()) for f in files}
    if sorted(ranks) != list(range(len(ranks))):
        raise ResumeStateError(f"checkpoint {folder}: loader states of ranks {sorted(ranks)}")
    states = [ranks[r] for r in range(len(ranks))]
    return {"format": STATES_FORMAT, "version": STATES_VERSION, "ranks": states}
