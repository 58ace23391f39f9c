"""A CPU hardware profile fitted from a measured bench, beside the H100 roofline.

`hardware.HardwareModel` prices a step from public accelerator figures. This
profile prices it from what `odb bench --model qwen3-vl-tiny` measured on this
machine (`simulator.bench_fit` fits it; docs/SIMULATOR.md, "Fidelity"):

    rank compute = token_s * real tokens + pad_token_s * padding tokens
                   + visual_token_s * visual tokens
    step         = max over ranks of rank compute + step_s

`step_s` is the per-step cost every rank pays once (gloo all-reduce, AdamW,
Python). Preprocessing one sample takes `sample_s + visual_token_s * visual`,
with one level in the rank process (`prep`: a length pass) and one in a
DataLoader worker (`worker_prep`: it also hands the sample to the rank through
shared memory, while other processes compete for the cores).
The trainer calls the same methods it calls on `HardwareModel`; the profile has
no memory limit and no all-reduce overlap (the all-reduce is inside `step_s`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from simulator.hardware import Network

# The fitted step model's features, in the order of `StepModel.coefficients`.
STEP_FEATURES = ("step_s", "token_s", "pad_token_s", "visual_token_s")


@dataclass(frozen=True)
class StepModel:
    step_s: float
    token_s: float
    pad_token_s: float
    visual_token_s: float

    def rank_s(self, real: float, computed: float, visual: float) -> float:
        return (
            self.token_s * real
            + self.pad_token_s * max(0.0, computed - real)
            + self.visual_token_s * visual
        )

    @property
    def coefficients(self) -> tuple[float, ...]:
        return tuple(getattr(self, k) for k in STEP_FEATURES)


@dataclass(frozen=True)
class PrepModel:
    """Seconds to preprocess one sample on one core."""

    sample_s: float
    visual_token_s: float

    def sample_cost(self, visual: float) -> float:
        return self.sample_s + self.visual_token_s * visual


@dataclass(frozen=True)
class CPUProfile:
    """The trainer's step-time interface (`HardwareModel`'s), from fitted figures."""

    step: StepModel
    prep: PrepModel
    worker_prep: PrepModel
    name: str = "cpu-fitted"
    source: str = ""
    network: Network = field(default_factory=Network)

    def __post_init__(self) -> None:
        for k, v in {**asdict(self.step), **asdict(self.prep), **asdict(self.worker_prep)}.items():
            if not math.isfinite(v):
                raise ValueError(f"fitted {k}={v!r} is not finite")

    def slot_s(self, real: int, computed: int, visual: int) -> float:
        return self.step.rank_s(real, computed, visual)

    # What the trainer and engine ask of `HardwareModel`:
    token_capacity = 1 << 62  # no memory model: a CPU bench sized to fit

    def default_budget(self) -> int:
        raise ValueError("a fitted CPU profile has no default budget: give the bench's")

    def allreduce_s(self, world: int) -> float:
        return 0.0  # measured inside step_s

    def last_bucket_s(self) -> float:
        return 0.0

    def optimizer_s(self) -> float:
        return self.step.step_s

    def backward_fraction(self) -> float:
        return 0.0

    def describe(self) -> dict[str, Any]:
        return {
            "profile": self.name,
            "source": self.source,
            "step": asdict(self.step),
            "prep": asdict(self.prep),
            "worker_prep": asdict(self.worker_prep),
        }
