"""What a `load_state_dict` resumed from, for the user (`ODBDataLoader.resume_report`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from odb_core.resume.record import ProgressRecord


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
    def of(progress: ProgressRecord, world_size: int) -> ResumeReport:
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
