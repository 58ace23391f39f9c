"""What each HF checkpoint folder holds beside the Trainer's own files (docs/TRAINERS.md,
"Hugging Face Trainer", `resume_from_checkpoint`): every rank's loader state in the
one format of every adapter (`odb_core.torch.checkpoint`, `STATES_FILE`) and the
run's plan (`TRAINER_STATE`, an `odb_core.torch.plan.RunPlan`)."""

from __future__ import annotations

import os
from typing import Any

from odb_core.errors import ConfigError
from odb_core.torch import ODBDataLoader
from odb_core.torch.checkpoint import (
    STATES_FILE,
    load_states,
    read_json,
    read_states,
    write_json,
    write_states,
)
from odb_core.torch.plan import RunPlan

__all__ = ["TRAINER_STATE", "resume_folder", "write_folder"]

#: The file each checkpoint folder gets beside the loader states (checkpoint.STATES_FILE).
TRAINER_STATE = "odb_trainer.json"


def write_folder(folder: str | os.PathLike[str], states: dict[str, Any], plan: RunPlan) -> None:
    """Write every rank's loader state (`gather_states`' entry) and the run's plan
    into `folder` (rank 0 writes)."""
    write_states(folder, states)
    write_json(folder, TRAINER_STATE, plan.to_dict())


def resume_folder(folder: str, loader: ODBDataLoader) -> RunPlan | None:
    """Resume `loader` from the states in `folder` and return the run's plan it holds
    (None: none); `ConfigError` when it holds no loader state."""
    entry = read_states(folder)
    if entry is None:
        raise ConfigError(
            f"checkpoint {folder} has no ODB loader state ({STATES_FILE}): it was not "
            "written by ODBHFTrainer, so the epoch cannot resume exactly once. Resume "
            "from a checkpoint ODBHFTrainer saved, or start the training anew"
        )
    load_states(loader, entry)
    return RunPlan.from_dict(read_json(folder, TRAINER_STATE), TRAINER_STATE)
