"""What one simulation runs: the strategies it knows, its faults (`Faults`) and
its configuration (`SimConfig`), validated whole at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from odb_core.config import (
    OversizePolicy,
    Sharding,
    coerce_enum,
    make_cost_model,
)
from odb_core.cost import Budget, CostKind, CostModel
from odb_core.errors import ConfigError
from odb_core.formers import FormerKind
from odb_core.sample import Sample
from simulator.hardware import HardwareModel
from simulator.workloads import Workload

STRATEGIES: dict[str, str] = {
    "standard": "fixed batch size per rank, padded (DistributedSampler order)",
    "gmt": "offline Global Max Tokens oracle: sort by cached length, cut at budget, shard",
    "gmt-safe": "gmt cut at the largest budget fraction whose batches all fit memory (opt-in)",
    "bmt": "offline Bucketed Max Tokens: sorted mega-buckets, packed at budget, shard",
    "grouped": "HF Trainer group_by_length: LengthGroupedSampler, Accelerate-sharded, padded",
    "grouped-modality": "LLaVA group_by_modality_length sampler, Accelerate-sharded, padded",
    "odb": "odb_core protocol, join mode, sort-window greedy former (or --former)",
    "odb-bfd": "odb_core protocol, join mode, best-fit-decreasing former",
    "odb-quota": "odb_core protocol, quota mode (first rank dry closes), odb's former",
    "odb-ref": "PyPI online-dynamic-batching grouping on the same stream (if installed)",
}
#: Run only when named: gmt-safe searches its head-room (a cut per 1% of budget).
OPT_IN_STRATEGIES = ("gmt-safe",)
DEFAULT_STRATEGIES = tuple(s for s in STRATEGIES if s not in OPT_IN_STRATEGIES)
#: The cost models the simulator times (its collation knows padded and packed rows).
COSTS = (CostKind.PACKED, CostKind.PADDED, CostKind.ATTENTION)


@dataclass(frozen=True)
class Faults:
    """Optional faults. Ranks and workers are 0-based."""

    stragglers: tuple[tuple[int, float], ...] = ()  # (rank, compute slowdown factor)
    stalls: tuple[tuple[int, int, float, float], ...] = ()  # (rank, worker, at_s, duration_s)
    slow_collective_prob: float = 0.0
    slow_collective_factor: float = 10.0
    dead_rank: int | None = None
    dead_at_s: float = 0.0

    def validate(self, world: int) -> None:
        for r, f in self.stragglers:
            _check_rank("straggler", r, world)
            if not (math.isfinite(f) and f >= 1):
                raise ConfigError(f"straggler factor {f!r} for rank {r} must be >= 1")
        for r, w, at, dur in self.stalls:
            _check_rank("stall", r, world)
            if w < 0 or not (math.isfinite(at) and at >= 0 and math.isfinite(dur) and dur > 0):
                raise ConfigError(f"stall {(r, w, at, dur)!r}: need worker>=0, at>=0, duration>0")
        if not 0 <= self.slow_collective_prob <= 1:
            raise ConfigError(
                f"slow collective probability {self.slow_collective_prob!r} not in [0,1]"
            )
        if not (math.isfinite(self.slow_collective_factor) and self.slow_collective_factor >= 1):
            raise ConfigError(
                f"slow collective factor {self.slow_collective_factor!r} must be >= 1"
            )
        if self.dead_rank is not None:
            _check_rank("dead", self.dead_rank, world)
            if not (math.isfinite(self.dead_at_s) and self.dead_at_s >= 0):
                raise ConfigError(f"death time {self.dead_at_s!r} must be >= 0")

    def describe(self) -> dict[str, Any]:
        return {
            "stragglers": [list(x) for x in self.stragglers],
            "stalls": [list(x) for x in self.stalls],
            "slow_collective_prob": self.slow_collective_prob,
            "slow_collective_factor": self.slow_collective_factor,
            "dead_rank": self.dead_rank,
            "dead_at_s": self.dead_at_s if self.dead_rank is not None else None,
        }


def _check_rank(what: str, r: int, world: int) -> None:
    if not 0 <= r < world:
        raise ConfigError(f"{what} rank {r!r} is not in [0, {world})")


@dataclass(frozen=True)
class SimConfig:
    workload: Workload
    ranks: int
    hardware: HardwareModel
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    seed: int = 0
    budget: int | None = None
    batch_size: int | None = None
    cost: CostKind = CostKind.PACKED  # or its value, e.g. "padded"
    attention_alpha: float = 1.0 / 4096
    buffer_size: int = 64
    former: FormerKind = FormerKind.SORT_WINDOW_GREEDY
    max_steps_per_round: int = 8
    quota: int | None = None
    oversize: OversizePolicy = OversizePolicy.SOLO
    num_workers: int = 4
    prefetch_factor: int = 2
    bmt_bucket: int = 4096
    peer_timeout_s: float = 60.0
    faults: Faults = field(default_factory=Faults)
    tail_window: int = 12
    sharding: Sharding | None = None
    """odb's sharding; None: dynamic, as the loader's default, but static with
    `early_form` (static-only) or the padded cost (a deal target below the window
    pads more), as in the loader."""
    early_form: int | None = None
    """odb (join mode): `ProtocolConfig.early_form`, the least partial window a rank
    forms early; None: off."""
    epochs: int = 1
    """Epochs run in a row; from the second on, odb's deals are priced by the costs
    its ranks observed in the one before (`odb_core.cost_table`), and every sample's
    cost varies from epoch to epoch by `epoch_noise` (augmentation)."""
    epoch_noise: float = 0.1
    """The relative spread (log-normal sigma) of a sample's cost between epochs."""
    cost_table: bool = True
    """From the second epoch, price odb's initial shares and deals by the costs
    learned in the one before; False: at the mean, as in the first (the control of
    the table's gain)."""
    early_form_wait_s: float = 0.25
    """A rank forms early only if its next sample is not there yet and the rest of
    its window would take longer than this to preprocess."""

    def __post_init__(self) -> None:
        for name in ("ranks", "buffer_size", "max_steps_per_round", "num_workers", "epochs"):
            _positive(name, getattr(self, name))
        _positive("prefetch_factor", self.prefetch_factor)
        _positive("bmt_bucket", self.bmt_bucket)
        if self.budget is not None:
            _positive("budget", self.budget)
        if self.batch_size is not None:
            _positive("batch size", self.batch_size)
        if self.quota is not None:
            _positive("quota", self.quota)
        if self.early_form is not None:
            _positive("early_form", self.early_form)
        if not (math.isfinite(self.early_form_wait_s) and self.early_form_wait_s >= 0):
            raise ConfigError(f"early form wait {self.early_form_wait_s!r} must be >= 0 seconds")
        if not (math.isfinite(self.epoch_noise) and self.epoch_noise >= 0):
            raise ConfigError(f"epoch noise {self.epoch_noise!r} must be >= 0")
        if not (math.isfinite(self.peer_timeout_s) and self.peer_timeout_s > 0):
            raise ConfigError(f"peer timeout {self.peer_timeout_s!r} must be > 0")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ConfigError(
                f"unknown strategy {unknown[0]!r}; expected one of {', '.join(STRATEGIES)}"
            )
        if not self.strategies:
            raise ConfigError("no strategy selected")
        cost = coerce_enum(CostKind, "cost model", self.cost)
        if cost not in COSTS:
            raise ConfigError(
                f"cost model {cost.value!r} is not simulated; expected one of "
                + ", ".join(repr(c.value) for c in COSTS)
            )
        object.__setattr__(self, "cost", cost)
        object.__setattr__(self, "former", coerce_enum(FormerKind, "former", self.former))
        sharding = self.sharding
        if sharding is None:  # the loader's default (odb_core.torch.options)
            static = self.early_form is not None or cost is CostKind.PADDED
            sharding = Sharding.STATIC if static else Sharding.DYNAMIC
        object.__setattr__(self, "sharding", coerce_enum(Sharding, "sharding", sharding))
        if not isinstance(self.oversize, OversizePolicy):
            object.__setattr__(self, "oversize", OversizePolicy(self.oversize))
        self.faults.validate(self.ranks)
        for r, w, _, _ in self.faults.stalls:
            if w >= self.num_workers:
                raise ConfigError(
                    f"stall worker {w} on rank {r} does not exist ({self.num_workers} workers)"
                )
        if self.oversize is OversizePolicy.ERROR:
            self._check_error_policy()

    def _check_error_policy(self) -> None:
        budget, model = Budget(self.token_budget), self.cost_model()
        lengths = self.workload.length
        smallest = int(lengths.min())
        if not budget.fits_alone(Sample(0, smallest), model):
            raise ConfigError(
                f"budget {self.token_budget} is smaller than the smallest sample "
                f"({smallest} tokens) under the 'error' oversize policy"
            )
        i = int(lengths.argmax())
        big = Sample(i, int(self.workload.text[i]), int(self.workload.visual[i]))
        if not budget.fits_alone(big, model):
            raise ConfigError(
                f"budget {self.token_budget} is smaller than sample {i} ({big.length} tokens) "
                "under the 'error' oversize policy; use --oversize solo or truncate"
            )

    @property
    def token_budget(self) -> int:
        return self.budget if self.budget is not None else self.hardware.default_budget()

    @property
    def standard_batch_size(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return max(1, self.hardware.token_capacity // int(self.workload.length.max()))

    def cost_model(self) -> CostModel:
        return make_cost_model(self.cost, alpha=self.attention_alpha)

    @property
    def padded_collation(self) -> bool:
        return self.cost is CostKind.PADDED

    @property
    def sharding_in_force(self) -> Sharding:
        """`sharding` as resolved by `__post_init__` (never None after it)."""
        assert self.sharding is not None
        return self.sharding

    def describe(self) -> dict[str, Any]:
        return {
            "workload": self.workload.name,
            "samples": self.workload.n,
            "ranks": self.ranks,
            "nodes": self.hardware.network.nodes,
            "seed": self.seed,
            "budget_tokens": self.token_budget,
            "standard_batch_size": self.standard_batch_size,
            "cost_model": self.cost.value,
            "buffer_size": self.buffer_size,
            "former": self.former.value,
            "sharding": self.sharding_in_force.value,
            "max_steps_per_round": self.max_steps_per_round,
            "quota": self.quota,
            "oversize": self.oversize.value,
            "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor,
            "bmt_bucket": self.bmt_bucket,
            "peer_timeout_s": self.peer_timeout_s,
            "strategies": list(self.strategies),
            "faults": self.faults.describe(),
            **(
                {"early_form": self.early_form, "early_form_wait_s": self.early_form_wait_s}
                if self.early_form is not None
                else {}
            ),
        }


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")
