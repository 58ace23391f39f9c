"""`EpochProgress`: the progress record with its codec and its checks, the one
class the loader and the tests hold."""

from __future__ import annotations

from typing import Any

from odb_core.resume import codec, consistency, fit
from odb_core.resume.record import ProgressRecord


class EpochProgress(ProgressRecord):
    """How far one epoch got (see the package docstring), as saved and loaded."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return codec.write(self)

    @staticmethod
    def from_dict(d: object) -> EpochProgress:
        """Parse and check a state: plain data of this version's schema whose checksum
        matches its content, and whose fields are consistent with each other (see
        `check`). Raises `ResumeStateError` naming the field."""
        progress = EpochProgress(**codec.read(d))
        progress.check()
        return progress

    def check(self) -> None:
        """Raise `ResumeStateError` unless the fields are consistent with each other:
        what every state the loader writes satisfies, whatever the dataset."""
        consistency.check(self)

    def check_for(self, target: fit.ResumeTarget) -> list[int] | None:
        """Raise `ResumeStateError` unless this state can be the progress of the
        loader described by `target` (its dataset, split and windows). Returns this
        rank's remaining ids, `shard(target.order, ...)`, when the check computed
        them on the way (a local state with done ids and no carry), else None."""
        return fit.check_fit(self, target)
