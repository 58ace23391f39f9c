"""`ODBDataLoader`'s keyword arguments, grouped by what they decide and validated in
one place before the loader does anything (no transport, no group, nothing half
applied); each error names the bad value.

- `BatchOptions`: how batches are formed (the budget and its cost model).
- `EpochOptions`: which samples an epoch holds, in which order, on which rank.
- `LossOptions`: what the loss is normalised by and the optimizer windows.
- `OutputOptions`: what each iteration yields.
- `WorkerOptions`: the inner torch DataLoader's workers and the prefetch.
- `peer_timeout`: how long a rank waits for its peers.

`LoaderOptions.of(**kwargs)` takes the loader's keyword arguments (the drop-in
names, unchanged); `check_dataset(dataset)` adds the checks that need the dataset.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from torch.utils.data import DistributedSampler, IterableDataset, Sampler

from odb_core.config import (
    LossNormalization,
    Mode,
    OversizePolicy,
    Sharding,
    coerce_enum,
    default_buffer_size,
)
from odb_core.cost import CostKind, CostModel
from odb_core.errors import ConfigError
from odb_core.formers import FormerKind
from odb_core.torch.measure import CostFn, LossTokensFn, TruncateFn

__all__ = [
    "DEFAULT_WINDOW_BYTES",
    "BatchOptions",
    "EpochOptions",
    "LoaderOptions",
    "LossOptions",
    "OutputOptions",
    "ShardingChoice",
    "WorkerOptions",
]


DEFAULT_WINDOW_BYTES = 1 << 30
"""The window's byte bound when none is given (join mode, static sharding in force):
the preprocessed samples a rank holds, in tensor bytes (benchmarks/window_bytes.py,
docs/ADAPTERS.md). Text-only windows stay far below it."""


@dataclass(frozen=True)
class ShardingChoice:
    """The sharding in force and why (`loader.describe()`, the loader's log line)."""

    sharding: Sharding
    reason: str
    given: bool
    """True: the user passed `sharding=`; False: the default chose it (a state saved
    under static then resumes under static: `ODBDataLoader.load_state_dict`)."""
    only_one_rank: bool = False
    """The default chose static only because the run has one rank (nothing to
    balance): a state saved under dynamic sharding resumes under dynamic."""


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


def _padded(model: Any) -> bool:
    """Whether a `cost_model=` argument is the padded cost (a name, kind or model)."""
    name = model if isinstance(model, str) else getattr(model, "value", None)
    if name is None:
        name = getattr(model, "name", None)
    return bool(name == CostKind.PADDED.value)


def _count(name: str, value: Any, least: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        what = "a non-negative integer" if least == 0 else f">= {least}"
        raise ConfigError(f"{name}={value!r} must be {what}")


@dataclass(frozen=True)
class BatchOptions:
    token_budget: float
    cost_fn: CostFn | None = None
    cost_model: CostModel | CostKind | str = CostKind.PACKED
    buffer_size: int | None = None
    max_steps_per_round: int = 8
    former: FormerKind | str = FormerKind.SORT_WINDOW_GREEDY
    oversize: OversizePolicy | str = OversizePolicy.ERROR
    max_samples: int | None = None
    max_patches: int | None = None
    early_form: int | None = None
    early_form_wait: float = 0.25
    window_bytes: int | None = None
    # The rest are checked by ProtocolConfig, which the loader builds from them.

    def __post_init__(self) -> None:
        if self.early_form is not None:
            _count("early_form", self.early_form, least=1)
        if self.window_bytes is not None:
            _count("window_bytes", self.window_bytes)
        w = self.early_form_wait
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"early_form_wait={w!r} must be a finite number of seconds >= 0")


@dataclass(frozen=True)
class EpochOptions:
    mode: Mode | str = Mode.JOIN
    quota: int | None = None
    seed: int = 0
    deterministic: bool = False
    shuffle: bool = False
    sampler: Sampler[Any] | Sequence[int] | None = None
    partition: bool = True
    id_fn: Callable[[Any], object] | None = None
    sharding: Sharding | str | None = None

    def __post_init__(self) -> None:
        _count("seed", self.seed)
        if isinstance(self.sampler, DistributedSampler) and self.partition:
            raise ConfigError(
                "sampler=DistributedSampler already splits (and pads with duplicates) the "
                "dataset across ranks; ODBDataLoader splits it itself with no duplicates: "
                "drop the sampler (use shuffle=True and seed=), or pass partition=False"
            )
        if self.sampler is not None and self.shuffle:
            raise ConfigError("sampler and shuffle=True are mutually exclusive (as in DataLoader)")

    @property
    def quota_mode(self) -> bool:
        return str(getattr(self.mode, "value", self.mode)) == Mode.QUOTA.value


@dataclass(frozen=True)
class LossOptions:
    loss_normalization: LossNormalization | str = LossNormalization.TOKENS
    loss_tokens_fn: LossTokensFn | None = None
    label_shift: int = 1
    ignore_index: int = -100
    truncate_fn: TruncateFn | None = None
    grad_accum_steps: int | None = None
    tokens_per_update: int | None = None

    def __post_init__(self) -> None:
        _count("label_shift", self.label_shift)
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ConfigError(f"ignore_index={self.ignore_index!r} must be an integer")
        if self.loss_tokens_fn is not None and not callable(self.loss_tokens_fn):
            raise ConfigError(f"loss_tokens_fn={self.loss_tokens_fn!r} is not callable")


@dataclass(frozen=True)
class OutputOptions:
    collate_fn: Callable[[list[Any]], Any] | None = None
    with_step_info: bool = False
    step_meta: bool = True
    trace_dir: str | Path | None = None

    def __post_init__(self) -> None:
        for name in ("step_meta", "with_step_info"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a bool")


@dataclass(frozen=True)
class WorkerOptions:
    num_workers: int = 0
    pin_memory: bool = False
    timeout: float = 0
    worker_init_fn: Callable[[int], None] | None = None
    multiprocessing_context: Any = None
    generator: Any = None
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory_device: str = ""
    samples_per_fetch: int = 8
    prefetch_thread: bool = True

    def __post_init__(self) -> None:
        _count("samples_per_fetch", self.samples_per_fetch, least=1)


_GROUPS = {
    "batch": BatchOptions,
    "epoch": EpochOptions,
    "loss": LossOptions,
    "output": OutputOptions,
    "workers": WorkerOptions,
}


@dataclass(frozen=True)
class LoaderOptions:
    """Every `ODBDataLoader` option, by group (see the module docstring)."""

    batch: BatchOptions
    epoch: EpochOptions
    loss: LossOptions
    output: OutputOptions
    workers: WorkerOptions
    peer_timeout: float = 300.0

    @classmethod
    def of(
        cls,
        *,
        peer_timeout: float = 300.0,
        batch_size: object = None,
        batch_sampler: object = None,
        drop_last: bool = False,
        **options: Any,
    ) -> LoaderOptions:
        """The loader's keyword arguments, grouped and checked (`ConfigError` names
        the first bad value); `batch_size`, `batch_sampler` and `drop_last` are the
        DataLoader's, which a token budget replaces."""
        if batch_size is not None:
            raise ConfigError(
                f"batch_size={batch_size!r} conflicts with token_budget: ODBDataLoader sizes "
                "each batch by its token cost (cap the samples per batch with max_samples=)"
            )
        if batch_sampler is not None:
            raise ConfigError(
                f"batch_sampler={batch_sampler!r} conflicts with token_budget: the protocol "
                "forms the batches"
            )
        if drop_last:
            raise ConfigError(
                "drop_last=True would drop samples; ODBDataLoader emits every sample of the "
                "epoch exactly once (mode='quota' closes epochs early with a ledger instead)"
            )
        if (
            isinstance(peer_timeout, bool)
            or not isinstance(peer_timeout, (int, float))
            or not math.isfinite(peer_timeout)
            or peer_timeout <= 0
        ):
            raise ConfigError(
                f"peer_timeout={peer_timeout!r} must be a finite number of seconds > 0"
            )
        groups: dict[str, Any] = {}
        for name, group in _GROUPS.items():
            names = {f.name for f in fields(group)}
            groups[name] = group(**{k: v for k, v in options.items() if k in names})
        unknown = set(options) - {f.name for g in _GROUPS.values() for f in fields(g)}
        if unknown:
            raise ConfigError(f"unknown ODBDataLoader option(s) {sorted(unknown)}")
        out = cls(peer_timeout=peer_timeout, **groups)
        out._check_early_form()
        out.window_bound(out.sharding(iterable=False).sharding)
        return out

    def sharding(self, *, iterable: bool, world: int = 2) -> ShardingChoice:
        """The sharding in force: `sharding=` when given; else dynamic wherever it can
        serve (a sized map-style dataset whose ids are its indices, split by the
        loader), static where it cannot or where an option needs static: an
        IterableDataset, `partition=False`, `id_fn=`, `sampler=` (its indices may
        repeat; a plan lists each id once), `early_form=`, a `window_bytes=` bound
        (join mode and static sharding only; unset, it applies only where static is
        in force), `deterministic=True` (its exact resume replays each rank's own
        state; a dynamic state resumes only merged), the padded cost model (a padded
        batch pads less the larger its window, 1,024 by default, and the deal target,
        at most half the split, would cut it: simulated at 64 ranks, odb/gmt 0.92 ->
        0.83 on ultrachat), or a world of one rank (nothing to balance, and a deal
        target below the window would only cut windows short)."""
        e, b = self.epoch, self.batch
        if e.sharding is not None:
            given = coerce_enum(Sharding, "sharding", e.sharding)
            return ShardingChoice(given, f"sharding={given.value!r} given", True)
        static_because = [
            (iterable, "an IterableDataset"),
            (not e.partition, "partition=False"),
            (e.id_fn is not None, "id_fn= given"),
            (e.sampler is not None, "sampler= given"),
            (b.early_form is not None, f"early_form={b.early_form!r} (static only)"),
            (bool(b.window_bytes), f"window_bytes={b.window_bytes!r} (static only)"),
            (e.deterministic, "deterministic=True (exact resume from each rank's state)"),
            (_padded(b.cost_model), "cost_model='padded' (the deal target would cut its window)"),
        ]
        why = [text for cond, text in static_because if cond]
        if why:
            return ShardingChoice(Sharding.STATIC, "default; static: " + ", ".join(why), False)
        if world == 1:
            return ShardingChoice(
                Sharding.STATIC, "default; static: one rank, nothing to balance", False, True
            )
        return ShardingChoice(Sharding.DYNAMIC, "default for a sized map-style dataset", False)

    def window_bound(self, sharding: Sharding) -> int | None:
        """`ProtocolConfig.window_bytes` under the sharding in force: `window_bytes=`,
        or DEFAULT_WINDOW_BYTES when it is None in join mode with static sharding
        (the core bounds bytes only there); 0 means no bound. A bound given for
        quota mode or dynamic sharding raises ConfigError."""
        given = self.batch.window_bytes
        e = self.epoch
        other = e.quota_mode or sharding is Sharding.DYNAMIC
        if given is None:
            return None if other else DEFAULT_WINDOW_BYTES
        if given and other:
            raise ConfigError(
                f"window_bytes={given!r} needs mode='join' and sharding='static' (got "
                f"mode={_value(e.mode)!r}, sharding={_value(e.sharding)!r}); leave it "
                "unset there"
            )
        return given or None

    def _check_early_form(self) -> None:
        """Early forms (issue 24): join mode, static sharding, a partial window, a
        protocol thread that may read the source ahead, and no promise of
        determinism (which batches form early depends on when samples arrive)."""
        k0 = self.batch.early_form
        if k0 is None:
            return
        e = self.epoch
        if e.quota_mode or self.sharding(iterable=False).sharding is Sharding.DYNAMIC:
            raise ConfigError(
                f"early_form={k0!r} needs mode='join' and sharding='static' (got "
                f"mode={_value(e.mode)!r}, sharding={_value(e.sharding)!r})"
            )
        if e.deterministic:
            raise ConfigError(
                f"early_form={k0!r} makes batch composition depend on when samples arrive, "
                "so it cannot be combined with deterministic=True (whose exact resume replays "
                "the same batches); drop one of them"
            )
        if not self.workers.prefetch_thread:
            raise ConfigError(
                f"early_form={k0!r} reads the source ahead on a thread to see whether the next "
                "sample is there; prefetch_thread=False runs everything in the iterating "
                "thread: drop one of them"
            )
        b = self.batch
        k: object = b.buffer_size
        model = b.cost_model
        if k is None and (isinstance(model, (str, CostKind)) or hasattr(model, "name")):
            k = default_buffer_size(model)
        if isinstance(k, int) and not isinstance(k, bool) and k0 >= k:
            raise ConfigError(
                f"early_form={k0!r} must be below buffer_size={k!r}: an early form is of a "
                "partial window"
            )

    def check_dataset(self, dataset: Any) -> bool:
        """The checks that need the dataset; True when it is an IterableDataset."""
        epoch = self.epoch
        iterable = isinstance(dataset, IterableDataset)
        if iterable and (epoch.shuffle or epoch.sampler is not None):
            raise ConfigError(
                "shuffle and sampler apply to map-style datasets; an IterableDataset "
                "defines its own order"
            )
        if epoch.quota_mode and (iterable or epoch.id_fn is not None):
            raise ConfigError(
                "mode='quota' carries the samples an epoch did not emit into the next one by "
                "dataset index, which needs a map-style dataset whose sample ids are its "
                f"indices; got {'an IterableDataset' if iterable else 'id_fn='}"
            )
        if not iterable and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise ConfigError(
                f"dataset {type(dataset).__name__} is neither an IterableDataset nor a sized "
                "map-style dataset (__getitem__ and __len__)"
            )
        return iterable
