"""Cost models and budgets: how much of the accelerator a batch uses.

A cost model maps the statistics of a batch to one number compared against
`Budget.tokens`. Statistics are accumulated incrementally so formers stay O(1)
per sample when they try an item against an open batch.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from odb_core.errors import ConfigError
from odb_core.sample import Sample


class BatchStats(NamedTuple):
    """Sufficient statistics of a batch for every cost model."""

    n: int = 0
    max_len: int = 0
    sum_len: int = 0
    sum_sq: int = 0
    sum_text: int = 0
    sum_visual: int = 0
    patches: int = 0

    def add(self, s: Sample) -> BatchStats:
        length = s.tokens + s.visual_tokens
        return BatchStats(
            self.n + 1,
            length if length > self.max_len else self.max_len,
            self.sum_len + length,
            self.sum_sq + length * length,
            self.sum_text + s.tokens,
            self.sum_visual + s.visual_tokens,
            self.patches + s.patches,
        )

    @staticmethod
    def single(s: Sample) -> BatchStats:
        length = s.tokens + s.visual_tokens
        return BatchStats(1, length, length, length * length, s.tokens, s.visual_tokens, s.patches)

    @staticmethod
    def of(samples: Iterable[Sample]) -> BatchStats:
        stats = BatchStats()
        for s in samples:
            stats = stats.add(s)
        return stats


class CostKind(enum.Enum):
    """The built-in cost models by name (`ODBDataLoader(cost_model=...)`, a trace's
    protocol); `odb_core.config.make_cost_model` builds one."""

    PACKED = "packed"
    """`PackedTokens`: Σ len."""
    PADDED = "padded"
    """`PaddedTokens`: n x max_len."""
    ATTENTION = "attention"
    """`AttentionAware`: Σ len + α·Σ len²."""
    MULTIMODAL = "multimodal"
    """`Multimodal`: Σ text + w·Σ visual."""


class CostModel(Protocol):
    """A pure function from batch statistics to cost, in budget units."""

    @property
    def name(self) -> str: ...

    def cost(self, stats: BatchStats) -> float: ...


@dataclass(frozen=True)
class PaddedTokens:
    """n x max_len: what a padded (non-packed) batch occupies."""

    @property
    def name(self) -> str:
        return CostKind.PADDED.value

    def cost(self, stats: BatchStats) -> float:
        return stats.n * stats.max_len


@dataclass(frozen=True)
class PackedTokens:
    """Σ len: a packed / varlen batch (e.g. flash-attention varlen)."""

    @property
    def name(self) -> str:
        return CostKind.PACKED.value

    def cost(self, stats: BatchStats) -> float:
        return stats.sum_len


@dataclass(frozen=True)
class AttentionAware:
    """Σ len + α·Σ len²: packed tokens plus the quadratic attention term."""

    alpha: float = 1.0 / 4096

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)):
            raise ConfigError(f"attention alpha={self.alpha!r} must be a finite number")
        if self.alpha < 0:
            raise ConfigError(f"attention alpha={self.alpha!r} must be >= 0")

    @property
    def name(self) -> str:
        return CostKind.ATTENTION.value

    def cost(self, stats: BatchStats) -> float:
        return stats.sum_len + self.alpha * stats.sum_sq


@dataclass(frozen=True)
class Multimodal:
    """Σ text tokens + w·Σ visual tokens; the patch cap lives in `Budget.max_patches`."""

    visual_weight: float = 1.0

    def __post_init__(self) -> None:
        w = self.visual_weight
        if not (isinstance(w, (int, float)) and math.isfinite(w)) or w < 0:
            raise ConfigError(f"multimodal visual_weight={w!r} must be a finite number >= 0")

    @property
    def name(self) -> str:
        return CostKind.MULTIMODAL.value

    def cost(self, stats: BatchStats) -> float:
        return stats.sum_text + self.visual_weight * stats.sum_visual


def _positive_int_or_none(field: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"budget {field}={value!r} must be a positive integer or None")


@dataclass(frozen=True)
class Budget:
    """Constraints a batch must satisfy together: cost AND samples AND patches."""

    tokens: float
    max_samples: int | None = None
    max_patches: int | None = None

    def __post_init__(self) -> None:
        t = self.tokens
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ConfigError(f"token_budget={t!r} must be a finite number")
        if t <= 0:
            raise ConfigError(f"token_budget={t!r} must be > 0")
        _positive_int_or_none("max_samples", self.max_samples)
        _positive_int_or_none("max_patches", self.max_patches)

    def fits(self, stats: BatchStats, model: CostModel) -> bool:
        if self.max_samples is not None and stats.n > self.max_samples:
            return False
        if self.max_patches is not None and stats.patches > self.max_patches:
            return False
        return model.cost(stats) <= self.tokens

    def fits_alone(self, s: Sample, model: CostModel) -> bool:
        return self.fits(BatchStats.single(s), model)
