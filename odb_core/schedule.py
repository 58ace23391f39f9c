"""Learning-rate schedules as pure functions of the run's progress, and the
token-aware learning-rate rule.

A schedule maps progress p in [0, 1] (`odb_core.progress.RunProgress.fraction`:
samples consumed by closed optimizer windows over the run's total) to a
multiplier of the peak learning rate. The clock is exact, so a schedule ends at
its final value on the last update whatever the number of steps; nothing is
sized from a step estimate.

    multiplier(p) = (p / w) * shape(0)                 p < w (linear warmup)
                  = shape((p - w) / (1 - w))           otherwise

Token-aware learning rate (opt-in): an update whose window holds T global loss
tokens uses `factor(T / reference)` times the scheduled rate, `T / reference`
(linear) or its square root (`TokenRule`). The window's tokens are known before
its first backward (the loader releases whole windows), so the update that
consumes them can use them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from odb_core.config import coerce_enum
from odb_core.errors import ConfigError
from odb_core.sample import Sample

ShapeFn = Callable[[float], float]


class Shape(enum.Enum):
    """The schedule after warmup, as a function of q in [0, 1] (0: the end of
    warmup, 1: the run's last update), from 1 to `final`."""

    LINEAR = "linear"
    COSINE = "cosine"
    CONSTANT = "constant"


class TokenRule(enum.Enum):
    """How an update's window loss tokens T scale its learning rate, relative to
    a reference R: by T / R (`LINEAR`, the rule for SGD-like noise scaling) or by
    sqrt(T / R) (`SQRT`, the usual rule for Adam)."""

    LINEAR = "linear"
    SQRT = "sqrt"


def _check_fraction(name: str, value: object, *, upper_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r} must be a number in [0, 1{')' if upper_open else ']'}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or v > 1 or (upper_open and v == 1):
        raise ConfigError(f"{name}={value!r} must be in [0, 1{')' if upper_open else ']'}")
    return v


@dataclass(frozen=True)
class Schedule:
    """`shape` (a `Shape`, its value, or a callable of q in [0, 1] returning the
    multiplier), `warmup` (the fraction of the run's progress spent ramping
    linearly from 0 to the shape's start) and `final` (the multiplier a LINEAR or
    COSINE shape ends at; 0 decays to zero)."""

    shape: Shape | ShapeFn = Shape.LINEAR
    warmup: float = 0.0
    final: float = 0.0

    def __post_init__(self) -> None:
        shape = self.shape
        if not callable(shape) or isinstance(shape, Shape):
            object.__setattr__(self, "shape", coerce_enum(Shape, "shape", shape))
        object.__setattr__(self, "warmup", _check_fraction("warmup", self.warmup, upper_open=True))
        object.__setattr__(self, "final", _check_fraction("final", self.final, upper_open=False))

    def multiplier(self, progress: float) -> float:
        """The multiplier of the peak learning rate at `progress` in [0, 1]."""
        p = _check_progress(progress)
        w = self.warmup
        if p < w:
            return (p / w) * self._shape(0.0)
        return self._shape((p - w) / (1.0 - w))

    def _shape(self, q: float) -> float:
        shape = self.shape
        if shape is Shape.CONSTANT:
            return 1.0
        if shape is Shape.LINEAR:
            return 1.0 - (1.0 - self.final) * q
        if shape is Shape.COSINE:
            return self.final + (1.0 - self.final) * 0.5 * (1.0 + math.cos(math.pi * q))
        assert callable(shape)
        value = shape(q)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"schedule shape returned {value!r} at q={q}; expected a number")
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"schedule shape returned {value!r} at q={q}; expected >= 0")
        return float(value)


def _check_progress(progress: float) -> float:
    if isinstance(progress, bool) or not isinstance(progress, (int, float)):
        raise ConfigError(f"progress={progress!r} must be a number in [0, 1]")
    p = float(progress)
    if not math.isfinite(p) or p < 0 or p > 1:
        raise ConfigError(f"progress={progress!r} must be in [0, 1]")
    return p


@dataclass(frozen=True)
class TokenScaling:
    """Scale each update's learning rate by its window's global loss tokens over
    `reference` tokens, by `rule`. A window without a loss token gets 0 (its
    gradient is zero anyway)."""

    reference: float
    rule: TokenRule = TokenRule.SQRT

    def __post_init__(self) -> None:
        object.__setattr__(self, "rule", coerce_enum(TokenRule, "rule", self.rule))
        ref = self.reference
        if (
            isinstance(ref, bool)
            or not isinstance(ref, (int, float))
            or not math.isfinite(ref)
            or ref <= 0
        ):
            raise ConfigError(f"reference={ref!r} must be a finite number of tokens > 0")

    def factor(self, window_loss_tokens: int) -> float:
        if isinstance(window_loss_tokens, bool) or not isinstance(window_loss_tokens, int):
            raise ConfigError(f"window_loss_tokens={window_loss_tokens!r} must be an integer")
        if window_loss_tokens < 0:
            raise ConfigError(f"window_loss_tokens={window_loss_tokens!r} must be >= 0")
        ratio = window_loss_tokens / self.reference
        return ratio if self.rule is TokenRule.LINEAR else math.sqrt(ratio)


@dataclass(frozen=True)
class SampleProfile:
    """Mean tokens of a measured sample of the dataset: `cost` (what the budget
    bounds) and `loss` (tokens whose loss counts) per sample, over `measured`."""

    measured: int
    cost_per_sample: float
    loss_per_sample: float

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> SampleProfile:
        if not samples:
            raise ConfigError("a sample profile needs at least one measured sample")
        n = len(samples)
        return cls(n, sum(s.length for s in samples) / n, sum(s.loss for s in samples) / n)


def fixed_batch_tokens(
    profile: SampleProfile, *, batch_size: int, world_size: int, grad_accum_steps: int = 1
) -> float:
    """The mean global loss tokens per update of the fixed-batch run this one
    replaces: `batch_size` samples per rank and step, `world_size` ranks,
    `grad_accum_steps` steps per update. Use it as `TokenScaling.reference`."""
    for name, value in (
        ("batch_size", batch_size),
        ("world_size", world_size),
        ("grad_accum_steps", grad_accum_steps),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    return batch_size * world_size * grad_accum_steps * profile.loss_per_sample


def match_fixed_batch(
    profile: SampleProfile, *, batch_size: int, world_size: int, grad_accum_steps: int = 1
) -> int:
    """`tokens_per_update` for an `ODBDataLoader` whose updates carry as many loss
    tokens as the fixed-batch run's (`fixed_batch_tokens`, rounded, at least 1):
    the same number of updates per epoch, and so the same learning-rate recipe."""
    return max(
        1,
        round(
            fixed_batch_tokens(
                profile,
                batch_size=batch_size,
                world_size=world_size,
                grad_accum_steps=grad_accum_steps,
            )
        ),
    )
