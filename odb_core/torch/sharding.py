"""Which dataset indices an epoch visits, in which order. The split across ranks
is `odb_core.resume.partition` (pure); only the seeded shuffle needs torch."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from odb_core.errors import ConfigError


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """Every index of a map-style dataset once; seeded per epoch so all ranks agree."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order: list[int] = torch.randperm(n, generator=g).tolist()
    return order


def sampler_order(sampler: Iterable[object]) -> list[int]:
    """A user sampler's indices for this epoch; the same sequence must come out on
    every rank (a seeded sampler) since the loader splits it across ranks."""
    out: list[int] = []
    for i in sampler:
        if isinstance(i, bool) or not isinstance(i, int):
            item = getattr(i, "item", None)
            if not callable(item):
                raise ConfigError(f"sampler yielded {i!r}; expected integer dataset indices")
            i = item()
            if not isinstance(i, int):
                raise ConfigError(f"sampler yielded {i!r}; expected integer dataset indices")
        out.append(i)
    return out
