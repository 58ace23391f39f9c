"""A batch the protocol emits: an ordered tuple of samples."""

from __future__ import annotations

from typing import NamedTuple

from odb_core.sample import Sample


class Batch(NamedTuple):
    """Samples that go into one optimizer step on one rank.

    `oversize` marks a solo batch holding one sample larger than the budget
    (the `solo` oversize policy); it is the only kind allowed over budget.
    """

    samples: tuple[Sample, ...]
    oversize: bool = False

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(s.id for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(s.tokens + s.visual_tokens for s in self.samples)

    @property
    def loss_tokens(self) -> int:
        """Tokens whose loss counts, summed over the batch (see Sample.loss)."""
        return sum(s.loss for s in self.samples)

    def __len__(self) -> int:
        return len(self.samples)
