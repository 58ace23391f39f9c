"""Exception types. Every error names the offending value."""

from __future__ import annotations

from enum import Enum


class ODBError(Exception):
    """Base class of every error raised by odb_core."""


class ConfigError(ODBError, ValueError):
    """An invalid configuration value, rejected before anything is applied."""


class SampleError(ODBError, ValueError):
    """A sample whose cost or identity is invalid."""


class OversizeSampleError(SampleError):
    """A sample larger than the budget under the `error` oversize policy."""


class DuplicateSampleError(SampleError):
    """A sample id observed twice in one epoch on one rank."""


class ProtocolError(ODBError, RuntimeError):
    """An event that is illegal in the rank's current protocol phase."""


class ODBPeerError(ODBError, RuntimeError):
    """A peer rank died, hung past `peer_timeout`, or sent an inconsistent message.
    `ranks`: the failed peers this rank could name (empty if it cannot tell);
    `cause`: a `PeerFault` (None where unknown)."""

    def __init__(
        self, message: str = "", *, ranks: tuple[int, ...] = (), cause: PeerFault | None = None
    ) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.cause = cause


class PeerFault(str, Enum):
    """Why a peer rank failed, as far as this rank can tell."""

    DIED = "died"  # its process is gone: the connection was reset or closed
    HUNG = "hung"  # alive or stopped, but it did not join within peer_timeout
    FAILED = "failed"  # it raised, and said so before leaving
    MISMATCH = "mismatch"  # it sent a message inconsistent with this rank's


class ResumeStateError(ConfigError):
    """A loader state refused by `load_state_dict` (schema, version, checksum, another
    dataset or config, or inconsistent progress). Nothing of it is applied."""


class ResumeMismatchError(ResumeStateError):
    """Ranks loaded states of different progress, found by the check every rank makes
    at the first iteration after a load; raised on every rank, and the loader is left
    as it was before the load. `field`: the state field that differs (`loaded` if
    not every rank loaded one, `done` if the done ids do not add up); `ranks`: the
    ranks whose value differs from most ranks' (every rank on a tie; for `loaded`,
    those that did not load; for `done`, all)."""

    def __init__(self, message: str, *, field: str = "", ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.field = field
        self.ranks = tuple(ranks)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), self.args, self.__dict__)


class DuplicateIdError(DuplicateSampleError):
    """A sample id emitted, or owned, by two ranks (or twice by one) in one epoch:
    `sample_id` and the `ranks` that hold it (a rank listed twice holds it twice)."""

    def __init__(self, message: str, *, sample_id: int = -1, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.sample_id = sample_id
        self.ranks = tuple(ranks)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), self.args, self.__dict__)


class EpochFinishedError(ConfigError):
    """`set_epoch(e)` names an epoch that has completed (iterated to its end, or
    loaded from a state saved after its last batch): training it again would
    repeat every one of its samples, so it needs `repeat=True`."""

    def __init__(self, epoch: int, finished: int) -> None:
        self.epoch = epoch
        self.finished = finished
        super().__init__(
            f"set_epoch({epoch}): epoch {epoch} has completed (epochs up to {finished} "
            f"are done); call set_epoch({finished + 1}) or just iterate to continue with "
            f"the next epoch, or set_epoch({epoch}, repeat=True) to train epoch {epoch} "
            "again on purpose"
        )
