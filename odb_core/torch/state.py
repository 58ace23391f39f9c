"""Plain-data loader state: the fingerprint that ties it to a dataset and config,
the merge of every rank's state for a resume at another world size, and what a
loader knows of its epoch to check a state against (`resume_target`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sized
from typing import Any

from odb_core.config import Mode, ProtocolConfig
from odb_core.resume import EpochProgress, ResumeTarget, merge
from odb_core.torch.sharding import epoch_order


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


def resume_target(
    progress: EpochProgress,
    config: ProtocolConfig,
    *,
    rank: int,
    length: int | None,
    id_fn: bool,
    partition: bool,
    sampler: object,
    shuffle: bool,
    seed: int,
) -> ResumeTarget:
    """What a loader knows of the epoch `progress` claims to be part of: its ids'
    range, its order and size (map-style, split by the loader), and the steps per
    optimizer window. Recomputes the epoch's order (a seeded permutation), never
    touches the user's sampler beyond len()."""
    indices = length is not None and not id_fn
    order: list[int] | None = None
    size: int | None = None
    if length is not None and partition:
        if sampler is None:
            size = length
            if indices:
                order = epoch_order(length, shuffle=shuffle, seed=seed, epoch=progress.epoch)
        elif isinstance(sampler, Sized):
            size = len(sampler)
    return ResumeTarget(
        world=config.world_size,
        rank=rank,
        join=config.mode is Mode.JOIN,
        id_limit=length if indices else None,
        order=order,
        size=size,
        steps_per_window=(config.grad_accum_steps or 1)
        if config.tokens_per_update is None
        else None,
    )
