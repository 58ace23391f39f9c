"""Typed protocol configuration, validated whole before anything uses it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar

from odb_core.assign import deal_target
from odb_core.cost import (
    AttentionAware,
    Budget,
    CostKind,
    CostModel,
    Multimodal,
    PackedTokens,
    PaddedTokens,
)
from odb_core.cost_table import CostTable
from odb_core.errors import ConfigError
from odb_core.formers import FormerKind


class Mode(enum.Enum):
    """How an epoch closes."""

    JOIN = "join"
    """Default. Every sample of the epoch is emitted exactly once; ranks that run
    out early emit pad steps so every rank runs the same number of steps."""
    QUOTA = "quota"
    """All ranks close at the same step once a global sample quota is met or the
    first rank runs dry; what was not emitted is carried in the ledger."""


class Sharding(enum.Enum):
    """Which rank loads which sample ids of the epoch."""

    STATIC = "static"
    """Default. Each rank owns a fixed 1/W of the epoch (its shard)."""
    DYNAMIC = "dynamic"
    """Ranks take ids from the epoch's plan as they go: each round's all-gather
    carries what every rank holds, and every rank deals the next plan ids to the
    ranks holding the least work with the same pure rule (`odb_core.assign`)."""


class OversizePolicy(enum.Enum):
    """What to do with one sample whose cost alone exceeds the budget."""

    ERROR = "error"
    SOLO = "solo"
    TRUNCATE = "truncate"


class LossNormalization(enum.Enum):
    """The global denominator `StepInfo.loss_scale` normalises by: the loss tokens
    (labels not masked) or the real samples of the step's optimizer window, over
    every rank."""

    TOKENS = "tokens"
    SAMPLES = "samples"


class WindowRule(enum.Enum):
    """How an optimizer (gradient-accumulation) window closes; see `ProtocolConfig`."""

    STEPS = "steps"
    """After `grad_accum_steps` aligned steps (1 by default: every step)."""
    TOKENS = "tokens"
    """At the first step at which the window's global loss tokens reach
    `tokens_per_update`."""


E = TypeVar("E", bound=enum.Enum)


def coerce_enum(kind: type[E], name: str, value: object) -> E:
    """Accept an enum member or its value; raise ConfigError naming the value otherwise."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(f"unknown {name} {value!r}; expected one of {allowed}") from None


def make_cost_model(
    kind: CostKind | str, *, alpha: float = 1.0 / 4096, visual_weight: float = 1.0
) -> CostModel:
    """The built-in cost model `kind` (a `CostKind` or its value); `alpha` is
    `AttentionAware`'s and `visual_weight` `Multimodal`'s, ignored by the others.
    An unknown name raises ConfigError naming it."""
    k = coerce_enum(CostKind, "cost model", kind)
    if k is CostKind.PACKED:
        return PackedTokens()
    if k is CostKind.PADDED:
        return PaddedTokens()
    if k is CostKind.ATTENTION:
        return AttentionAware(alpha)
    return Multimodal(visual_weight)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")
    return value


@dataclass(frozen=True)
class ProtocolConfig:
    """Everything the DGAP protocol needs, identical on every rank.

    `buffer_size` is the window K a rank fills before forming batches;
    `max_steps_per_round` (M) caps the steps agreed per collective and so the
    size of the all-gathered vector (2 + 3M integers).

    Optimizer windows (gradient accumulation): `grad_accum_steps=G` closes a
    window every G aligned steps, `tokens_per_update=T` at the first step at which
    the window's global loss tokens reach T; at most one of the two, and with
    neither every step is its own window. The last window of an epoch closes with
    the epoch, however short. Every rank derives the same boundaries from the
    rounds' all-gathers, and a step's loss scale normalises by its whole window.
    """

    world_size: int
    budget: Budget
    cost_model: CostModel = field(default_factory=PackedTokens)
    buffer_size: int = 64
    mode: Mode = Mode.JOIN
    former: FormerKind = FormerKind.SORT_WINDOW_GREEDY
    oversize: OversizePolicy = OversizePolicy.ERROR
    max_steps_per_round: int = 8
    quota: int | None = None
    deterministic: bool = False
    loss_normalization: LossNormalization = LossNormalization.TOKENS
    grad_accum_steps: int | None = None
    tokens_per_update: int | None = None
    sharding: Sharding = Sharding.STATIC
    plan: tuple[int, ...] = ()
    """Dynamic sharding: the epoch's sample ids in the order they are dealt (the
    same tuple on every rank). With a `cost_table` its initial prefix is placed by
    the table's prices as the config is built (`CostTable.placed`: the same ids,
    reordered so that each rank's initial share is one run). Not part of
    `describe()`: it changes every epoch."""
    assign_target: int | None = None
    """Dynamic sharding: the configured target T, the window size `buffer_size` when
    not set. The deal tops each rank up to `target`, which is T bounded by the
    plan's half split (`assign.deal_target`)."""
    cost_table: CostTable | None = None
    """Dynamic sharding: the costs observed in an earlier epoch, which price the deal's
    ids (`odb_core.cost_table`; None: every unread id at the gathered mean). Placement
    only: the ids dealt, and so every guarantee, do not depend on it. Not part of
    `describe()`: it is learned, and a state without it resumes with mean pricing."""
    carried: frozenset[int] = frozenset()
    """Quota mode: the ids this pass took over from the last one's ledger (the
    same set on every rank); each rank forms them ahead of fresh samples
    (`formers.carried_first`, proofs/cross_epoch_fairness.md). Not part of
    `describe()`: it changes every pass, the config does not."""
    early_form: int | None = None
    """The least partial window a rank may form early (`RankMachine.form_early`:
    nothing ready and its driver sees the next sample is not there yet; it emits
    only the fullest batch and keeps the rest). None: a rank forms only a full
    window or a dry source's rest. Join mode and static sharding only."""
    window_bytes: int | None = None
    """A bound on the bytes of the window (each sample's size as its driver measured
    it, `RankMachine.observe(sample, nbytes)`). A window whose bytes reach it forms
    early (`RankMachine.form_early`, here the core's own choice: the fullest batch
    goes, the rest waits), and a waiting rank prefetches only below it. None: no
    bound. Join mode and static sharding only, like early forms. Not part of
    `describe()`: a memory setting, a state saved under another bound resumes."""

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size)
        _positive_int("buffer_size", self.buffer_size)
        _positive_int("max_steps_per_round", self.max_steps_per_round)
        if not isinstance(self.budget, Budget):
            raise ConfigError(f"budget={self.budget!r} must be a Budget")
        if not callable(getattr(self.cost_model, "cost", None)):
            raise ConfigError(f"cost_model={self.cost_model!r} has no cost(stats) method")
        object.__setattr__(self, "mode", coerce_enum(Mode, "mode", self.mode))
        object.__setattr__(self, "former", coerce_enum(FormerKind, "former", self.former))
        object.__setattr__(
            self, "oversize", coerce_enum(OversizePolicy, "oversize policy", self.oversize)
        )
        object.__setattr__(
            self,
            "loss_normalization",
            coerce_enum(LossNormalization, "loss normalization", self.loss_normalization),
        )
        if self.quota is not None:
            _positive_int("quota", self.quota)
            if self.mode is not Mode.QUOTA:
                raise ConfigError(f"quota={self.quota!r} is only meaningful with mode='quota'")
        object.__setattr__(self, "sharding", coerce_enum(Sharding, "sharding", self.sharding))
        if not isinstance(self.plan, tuple):
            if isinstance(self.plan, (str, bytes)) or not hasattr(self.plan, "__iter__"):
                raise ConfigError(f"plan={self.plan!r} must be a sequence of sample ids")
            object.__setattr__(self, "plan", tuple(self.plan))
        bad_ids = [i for i in self.plan if isinstance(i, bool) or not isinstance(i, int)]
        if bad_ids:
            raise ConfigError(f"plan holds {bad_ids[0]!r}, which is not an integer sample id")
        if len(set(self.plan)) != len(self.plan):
            raise ConfigError("plan lists a sample id twice")
        if self.plan and self.sharding is not Sharding.DYNAMIC:
            raise ConfigError("a plan is only meaningful with sharding='dynamic'")
        if self.cost_table is not None:
            if not isinstance(self.cost_table, CostTable):
                raise ConfigError(f"cost_table={self.cost_table!r} must be a CostTable")
            if self.sharding is not Sharding.DYNAMIC:
                raise ConfigError("a cost table prices deals: it needs sharding='dynamic'")
        if self.assign_target is not None:
            _positive_int("assign_target", self.assign_target)
        if self.cost_table is not None and self.plan:
            # The initial shares by the table's prices (`CostTable.placed`): agreed
            # state, and a fixed point, so every rank's config holds the same plan.
            placed, _ = self.cost_table.placed(self.plan, self.world_size, self.configured_target)
            object.__setattr__(self, "plan", placed)
        if not isinstance(self.deterministic, bool):
            raise ConfigError(f"deterministic={self.deterministic!r} must be a bool")
        if self.grad_accum_steps is not None and self.tokens_per_update is not None:
            raise ConfigError(
                f"grad_accum_steps={self.grad_accum_steps!r} and tokens_per_update="
                f"{self.tokens_per_update!r} both close optimizer windows; give one of them"
            )
        if self.grad_accum_steps is not None:
            _positive_int("grad_accum_steps", self.grad_accum_steps)
        if self.tokens_per_update is not None:
            _positive_int("tokens_per_update", self.tokens_per_update)
        if not isinstance(self.carried, frozenset):
            if isinstance(self.carried, (str, bytes)) or not hasattr(self.carried, "__iter__"):
                raise ConfigError(f"carried={self.carried!r} must be a set of sample ids")
            object.__setattr__(self, "carried", frozenset(self.carried))
        bad = [i for i in self.carried if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise ConfigError(f"carried holds {bad[0]!r}, which is not an integer sample id")
        if self.carried and self.mode is not Mode.QUOTA:
            raise ConfigError(
                f"carried ids ({len(self.carried)}) are only meaningful with mode='quota'"
            )
        if self.early_form is not None:
            _positive_int("early_form", self.early_form)
            if self.early_form >= self.buffer_size:
                raise ConfigError(
                    f"early_form={self.early_form!r} must be below buffer_size="
                    f"{self.buffer_size!r}: an early form is of a partial window"
                )
            if self.mode is not Mode.JOIN or self.dynamic:
                raise ConfigError(
                    f"early_form={self.early_form!r} needs mode='join' and sharding='static' "
                    f"(got mode={self.mode.value!r}, sharding={self.sharding.value!r})"
                )
        if self.window_bytes is not None:
            _positive_int("window_bytes", self.window_bytes)
            if self.mode is not Mode.JOIN or self.dynamic:
                raise ConfigError(
                    f"window_bytes={self.window_bytes!r} needs mode='join' and "
                    f"sharding='static' (got mode={self.mode.value!r}, "
                    f"sharding={self.sharding.value!r})"
                )

    @property
    def window_rule(self) -> WindowRule:
        return WindowRule.STEPS if self.tokens_per_update is None else WindowRule.TOKENS

    @property
    def dynamic(self) -> bool:
        return self.sharding is Sharding.DYNAMIC

    @property
    def configured_target(self) -> int:
        """Dynamic sharding: the target T as configured (`assign_target`, else the
        window); the spec's constant `Target`."""
        return self.buffer_size if self.assign_target is None else self.assign_target

    @property
    def target(self) -> int:
        """Dynamic sharding: samples (held + dealt, not yet emitted) each rank is
        topped up to per round: `assign.deal_target` of the configured target, the
        plan's length and the world size (the configured target when static or
        without a plan yet: a loader's config before its epoch's plan; the initial
        share is the same with either, `assign.deal_target`)."""
        t = self.configured_target
        return deal_target(len(self.plan), self.world_size, t) if self.dynamic and self.plan else t

    @property
    def accum_steps(self) -> int:
        """Steps per window under the STEPS rule (1 when not set)."""
        return 1 if self.grad_accum_steps is None else self.grad_accum_steps

    def describe(self) -> dict[str, Any]:
        """Plain-data summary, used in reports and to fingerprint resumable state."""
        out: dict[str, Any] = {
            "world_size": self.world_size,
            "budget_tokens": self.budget.tokens,
            "max_samples": self.budget.max_samples,
            "max_patches": self.budget.max_patches,
            "cost_model": self.cost_model.name,
            "buffer_size": self.buffer_size,
            "mode": self.mode.value,
            "former": self.former.value,
            "oversize": self.oversize.value,
            "max_steps_per_round": self.max_steps_per_round,
            "quota": self.quota,
            "deterministic": self.deterministic,
            "loss_normalization": self.loss_normalization.value,
            "grad_accum_steps": self.grad_accum_steps,
            "tokens_per_update": self.tokens_per_update,
        }
        if self.dynamic:  # static configs keep the fingerprint they always had
            out["sharding"] = self.sharding.value
            out["assign_target"] = self.assign_target
        if self.early_form is not None:  # likewise
            out["early_form"] = self.early_form
        return out


DEFAULT_BUFFER_SIZE = 64
PADDED_BUFFER_SIZE = 1024


def default_buffer_size(cost_model: CostModel | CostKind | str) -> int:
    """The window K a rank fills before forming, when none is given: 1,024 samples
    under the padded cost model, 64 otherwise. A padded batch costs n x its
    longest sample, so its padding falls only when a window holds many samples of
    close lengths (measured: 28% padding at 64, 11% at 256 on a long-tail CPU
    run; `odb simulate --cost padded --ranks 8`: ultrachat pads 10.3% at 256,
    3.3% at 1,024, odb/gmt 0.90x -> 0.97x); a packed batch pays no padding, and a
    larger window only holds more samples. The price is host memory for K
    preprocessed samples per rank and a longer first fill (docs/SIMULATOR.md)."""
    if isinstance(cost_model, CostKind):
        name = cost_model.value
    else:
        name = cost_model if isinstance(cost_model, str) else cost_model.name
    return PADDED_BUFFER_SIZE if name == CostKind.PADDED.value else DEFAULT_BUFFER_SIZE
