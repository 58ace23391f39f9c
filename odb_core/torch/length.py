"""The loader's length: an estimate of the epoch's steps, for progress bars and
planned totals, and the realised counts of finished epochs.

The estimate is the core's (`odb_core.estimate`): the rank machine forms batches
from bootstrap draws of `COST_SAMPLE` measured samples, picked by a fixed seed,
so every rank reads the same samples and gets the same figure. They are read
once, in the main process, the first time a length is asked for; a trainer
that never asks pays nothing. The first estimate (`planned`) is kept as made, so
`len(loader)` is stable; once epochs have finished, their realised counts refine
`steps_estimate()`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

from odb_core.config import ProtocolConfig
from odb_core.estimate import StepsEstimate, estimate_epoch_steps, update
from odb_core.sample import Sample

COST_SAMPLE = 256
_SEED = 0x0DB

log = logging.getLogger("odb_core")


class EpochLength:
    """Estimates per epoch and the realised step counts (`realised[epoch]`)."""

    def __init__(self, config: ProtocolConfig) -> None:
        self.config = config
        self.realised: dict[int, int] = {}
        self._costs: list[Sample] | None = None
        self._first: StepsEstimate | None = None

    def estimate(
        self,
        dataset_size: int,
        shard_sizes: Sequence[int],
        measure: Callable[[int], Sample],
    ) -> StepsEstimate:
        if self._first is None:
            costs = self._sample(dataset_size, measure)
            self._first = estimate_epoch_steps(self.config, costs, shard_sizes)
            log.info(
                "odb: an epoch is estimated at %d steps (upper %d) from %s",
                self._first.steps,
                self._first.upper,
                self._first.basis,
            )
        return update(self._first, list(self.realised.values()))

    @property
    def planned(self) -> StepsEstimate | None:
        """The estimate made before any epoch ran (None until asked for once)."""
        return self._first

    @property
    def costs(self) -> list[Sample]:
        """The measured samples the estimate is made from (empty until asked for)."""
        return list(self._costs or ())

    def record(self, epoch: int, steps: int) -> None:
        self.realised[epoch] = steps
        if self._first is not None:
            err = (self._first.steps - steps) / max(1, steps)
            log.info(
                "odb: epoch %d ran %d steps (estimated %d before any epoch: %+.1f%%)",
                epoch,
                steps,
                self._first.steps,
                100 * err,
            )

    def _sample(self, size: int, measure: Callable[[int], Sample]) -> list[Sample]:
        if self._costs is None:
            self._costs = [measure(i) for i in cost_sample_ids(size)]
        return self._costs


def cost_sample_ids(size: int) -> list[int]:
    """The dataset indices measured for estimates and profiles: `COST_SAMPLE` of
    them (all when fewer), picked by a fixed seed, the same on every rank."""
    return random.Random(_SEED).sample(range(size), min(COST_SAMPLE, size))


def shard_sizes(length: int, world: int) -> list[int]:
    """Samples per rank of a round-robin split of `length` samples."""
    return [len(range(r, length, world)) for r in range(world)]


def describe(estimate: StepsEstimate) -> dict[str, Any]:
    return {"steps": estimate.steps, "upper": estimate.upper, "basis": estimate.basis}
