"""The checks of a state loaded into an `ODBDataLoader` (`load_state_dict`), before
anything is applied: its form (`EpochProgress.from_dict`, or every rank's merged),
the learned cost table it carries, the fingerprint of the dataset and config it was
saved under (`Identity`: a state saved under the other sharding resumes under its
own where the default chose), and its fit to this rank's order; and, at the first
iteration after the load, the one collective in which every rank checks what
every other rank loaded (`verify_claims`).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from odb_core.config import ProtocolConfig, Sharding
from odb_core.cost_table import CostTable
from odb_core.errors import ResumeStateError
from odb_core.resume import EpochProgress, ResumeClaim, check_claims, fingerprint_mismatch, merge
from odb_core.torch.options import LoaderOptions, ShardingChoice
from odb_core.torch.rank_source import LoadedOrder
from odb_core.torch.state import fingerprint, resume_target
from odb_core.torch.transport import Transport

__all__ = ["TABLE_KEY", "Identity", "StateChecks", "verify_claims", "with_table", "without_table"]

TABLE_KEY = "cost_table"
_RESUME_TAG = -2  # marks the resume check's collective (order digests are >= 0)

State = Mapping[str, Any] | Sequence[Mapping[str, Any]]


class Identity(NamedTuple):
    """What a loader's states are saved and resumed under."""

    config: ProtocolConfig
    fingerprint: dict[str, Any]
    digest: int
    """The fingerprint's checksum: the tag of every collective of the loader."""
    sharding: ShardingChoice


class StateChecks:
    """The checks of a loaded state against one loader: its dataset, options and
    place (rank, world size)."""

    def __init__(
        self, dataset: Any, options: LoaderOptions, *, iterable: bool, rank: int, world_size: int
    ) -> None:
        self.dataset = dataset
        self.options = options
        self.iterable = iterable
        self.rank = rank
        self.world_size = world_size

    def identity(self, config: ProtocolConfig, sharding: ShardingChoice) -> Identity:
        """The fingerprint a state saved under `config` carries, and its digest."""
        o, e = self.options, self.options.epoch
        fp = fingerprint(
            self.dataset,
            config,
            kind="iterable" if self.iterable else "map",
            length=None if self.iterable else len(self.dataset),
            seed=e.seed,
            shuffle=e.shuffle,
            partition=e.partition,
            sampler=e.sampler,
        )
        fp["id_fn"] = e.id_fn is not None
        fp["loss_tokens_fn"] = o.loss.loss_tokens_fn is not None
        fp["label_shift"] = o.loss.label_shift
        fp["ignore_index"] = o.loss.ignore_index
        digest = zlib.crc32(json.dumps(fp, sort_keys=True, default=str).encode())
        return Identity(config, fp, digest, sharding)

    def table(self, state: State) -> CostTable | None:
        """The cost table a state (or every rank's, which must agree) carries, checked
        (`CostTable.from_state`: shape, size = the dataset's length, checksum); None
        when absent."""
        states = [state] if isinstance(state, Mapping) else list(state)
        size = None if self.iterable else len(self.dataset)
        tables = [
            None
            if not isinstance(s, Mapping) or TABLE_KEY not in s
            else CostTable.from_state(s[TABLE_KEY], size)
            for s in states
        ]
        if any(t != tables[0] for t in tables[1:]):
            raise ResumeStateError(
                "loader state field cost_table differs between the ranks' states: every "
                "rank prices the deals by the same table"
            )
        return tables[0] if tables else None

    def progress(
        self, state: State, here: Identity
    ) -> tuple[EpochProgress, Identity, LoadedOrder | None]:
        """The progress of `state` (without its table), checked; the identity it
        resumes under (`adopt`); and the order computed to check it (see LoadedOrder)."""
        if isinstance(state, Mapping):
            progress = EpochProgress.from_dict(state)
        elif isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
            progress = merge(EpochProgress.from_dict(s) for s in state)
        else:
            raise ResumeStateError(
                f"load_state_dict expects a state dict or a list of them, got {state!r}"
            )
        identity = self.adopt(progress, here)
        config = identity.config
        # One rank's state of a one-rank run is the whole run's.
        if config.dynamic and not progress.is_global and progress.world_size != 1:
            raise ResumeStateError(
                f"this loader deals ids by dynamic sharding ({identity.sharding.reason}), which "
                f"resumes from every rank's state, merged (load_state_dict([s0, s1, ...]), "
                f"or gather_states/load_states), not rank {progress.rank}'s alone: its done "
                "ids are not the run's; pass sharding='static' to resume each rank from its own"
            )
        diff = fingerprint_mismatch(identity.fingerprint, progress.fingerprint)
        if diff:
            hint = ""
            if any(d.startswith("protocol.sharding:") for d in diff):
                hint = (
                    " (sharding: the state was saved under another sharding; pass the "
                    "saved run's sharding= to resume it)"
                )
            raise ResumeStateError(
                "loader state is from another dataset or config: " + "; ".join(diff) + hint
            )
        return progress, identity, self._order(progress, config)

    def _order(self, progress: EpochProgress, config: ProtocolConfig) -> LoadedOrder | None:
        e = self.options.epoch
        length = None if self.iterable else len(self.dataset)
        target = resume_target(
            progress,
            config,
            rank=self.rank,
            length=length,
            id_fn=e.id_fn is not None,
            partition=e.partition,
            sampler=e.sampler,
            shuffle=e.shuffle,
            seed=e.seed,
        )
        remaining = progress.check_for(target)
        if target.order is None or length is None:
            return None
        key = (progress.epoch, length, e.shuffle, e.seed)
        return (key, target.order, (progress, self.world_size, self.rank), remaining)

    def adopt(self, progress: EpochProgress, here: Identity) -> Identity:
        """The identity this loader resumes `progress` under. When the default chose
        the sharding, a state saved under the other one resumes under its own where
        it can: a static state (whose fingerprint has no `protocol.sharding`: every
        state of a run before dynamic became the default) under static, since its
        done ids are per-rank shards that only static resumes; a dynamic state under
        dynamic where only the one rank made the default static. A `sharding=`
        given, or a default that chose static for a reason dynamic cannot serve, is
        kept: a mismatch is then a fingerprint error naming `protocol.sharding`."""
        choice = here.sharding
        saved = progress.fingerprint.get("protocol.sharding", Sharding.STATIC.value)
        if choice.given or saved == choice.sharding.value:
            return here
        if saved == Sharding.STATIC.value:
            adopt = Sharding.STATIC
        elif saved == Sharding.DYNAMIC.value and choice.only_one_rank:
            adopt = Sharding.DYNAMIC
        else:
            return here
        config = replace(here.config, sharding=adopt, window_bytes=self.options.window_bound(adopt))
        why = f"default; {adopt.value}: resumed from a state saved under {adopt.value}"
        return self.identity(config, ShardingChoice(adopt, why, False))


def without_table(state: State) -> State:
    """The state(s) without the cost table, which `EpochProgress` does not hold."""

    def strip(s: Mapping[str, Any]) -> Mapping[str, Any]:
        if isinstance(s, Mapping) and TABLE_KEY in s:
            return {k: v for k, v in s.items() if k != TABLE_KEY}
        return s

    if isinstance(state, Mapping):
        return strip(state)
    if isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
        return [strip(s) for s in state]
    return state


def with_table(
    state: dict[str, Any], table: CostTable | None, learned: CostTable | None
) -> dict[str, Any]:
    """A state with the learned cost table the next deals are priced by (dynamic
    sharding; absent when there is none: a resume then prices at the mean): `table`,
    or `learned` (what the epoch's close taught) for a closed state, which resumes
    with the next epoch."""
    if state.get("closed") and learned is not None:
        table = learned
    if table is not None:
        state[TABLE_KEY] = table.to_state()
    return state


def verify_claims(
    transport: Transport,
    digest: int,
    iteration: int,
    resume: EpochProgress | None,
    *,
    refused: bool,
    rank: int,
) -> None:
    """The first iteration after a load: one collective in which every rank checks
    that every rank loaded the same progress (resume.check_claims)."""
    claim = ResumeClaim.of(resume, refused=refused)
    rows = transport.exchange(
        (digest, _RESUME_TAG, iteration),
        claim.to_vector(),
        "the resume check of the first iteration",
    )
    check_claims(rows, rank)
