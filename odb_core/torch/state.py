"""Plain-data loader state: the fingerprint that ties it to a dataset and config,
and the merge of every rank's state for a resume at another world size."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from odb_core.config import ProtocolConfig
from odb_core.resume import EpochProgress, merge


def fingerprint(
    dataset: object,
    config: ProtocolConfig,
    *,
    kind: str,
    length: int | None,
    seed: int,
    shuffle: bool,
    partition: bool,
    sampler: object,
) -> dict[str, Any]:
    protocol = {f"protocol.{k}": v for k, v in config.describe().items()}
    del protocol["protocol.world_size"]  # a state resumes at any world size
    return {
        "dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
        "kind": kind,
        "length": length,
        "seed": seed,
        "shuffle": shuffle,
        "partition": partition,
        "sampler": None if sampler is None else type(sampler).__qualname__,
        **protocol,
    }


def merge_states(states: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge every rank's `state_dict()` (taken at the same step) into one state that
    resumes the epoch at any world size."""
    return merge(EpochProgress.from_dict(s) for s in states).to_dict()
