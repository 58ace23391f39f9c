"""One global progress record from the local records of every rank, taken at the
same step: it resumes the epoch at any world size."""

from __future__ import annotations

from collections.abc import Iterable

from odb_core.errors import ResumeMismatchError, ResumeStateError
from odb_core.resume.claims import _check_count
from odb_core.resume.codec import _preview
from odb_core.resume.epoch_progress import EpochProgress
from odb_core.resume.fit import fingerprint_mismatch
from odb_core.resume.record import SHARED


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
