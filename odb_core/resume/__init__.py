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

The package, one job per module: `record` (the fields, written once, and the
split of the order), `codec` (plain data, schema, checksum), `consistency` (one
state's fields agree), `fit` (a state fits this loader's dataset and config),
`merged` (every rank's states as one), `claims` (the cross-rank check at the
first iteration after a load) and `report` (what a load resumed from).
"""

from odb_core.resume.claims import ResumeClaim, check_claims
from odb_core.resume.codec import FIELDS, STATE_VERSION, canonical, checksum, seal
from odb_core.resume.epoch_progress import EpochProgress
from odb_core.resume.fit import ResumeTarget, fingerprint_mismatch
from odb_core.resume.merged import merge
from odb_core.resume.record import SHARED, ProgressRecord, partition
from odb_core.resume.report import ResumeReport

__all__ = [
    "FIELDS",
    "SHARED",
    "STATE_VERSION",
    "EpochProgress",
    "ProgressRecord",
    "ResumeClaim",
    "ResumeReport",
    "ResumeTarget",
    "canonical",
    "check_claims",
    "checksum",
    "fingerprint_mismatch",
    "merge",
    "partition",
    "seal",
]
