"""`ODBDataLoader`'s keyword arguments, grouped by what they decide and validated in
one place before the loader does anything (no transport, no group, nothing half
applied); each error names the bad value. Each option is one field, documented
where it is declared; the loader reads `loader.options.<group>.<field>`.

- `BatchOptions`: how batches are formed (the budget and its cost model).
- `EpochOptions`: which samples an epoch holds, in which order, on which rank.
- `LossOptions`: what the loss is normalised by and the optimizer windows.
- `OutputOptions`: what each iteration yields.
- `WorkerOptions`: the inner torch DataLoader's workers and the prefetch.
- `peer_timeout`: how long a rank waits for its peers.

Each group lists its everyday options first and its advanced knobs (tuning, not
needed to use the loader) after an `# Advanced` line.

`LoaderOptions.of(**kwargs)` takes the loader's keyword arguments (the drop-in
names, unchanged); `check_dataset(dataset)` adds the checks that need the dataset,
`protocol_config(world_size, sharding)` builds the core's `ProtocolConfig` from
them and `check_placement` the checks that need the world and the config.
`OPTION_DEFAULTS` holds every option's default (what `ODBArguments` starts from).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from torch.utils.data import DistributedSampler, IterableDataset, Sampler, default_collate

from odb_core.config import (
    LossNormalization,
    Mode,
    OversizePolicy,
    ProtocolConfig,
    Sharding,
    coerce_enum,
    default_buffer_size,
    make_cost_model,
)
from odb_core.cost import Budget, CostKind, CostModel
from odb_core.errors import ConfigError
from odb_core.formers import FormerKind
from odb_core.torch.measure import CostFn, LossTokensFn, TruncateFn

__all__ = [
    "DEFAULT_WINDOW_BYTES",
    "OPTION_DEFAULTS",
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
    """How batches are formed: the budget, its cost model, the window they form from."""

    token_budget: float
    """The budget of every batch, under `cost_model` (tokens, for the built-in models)."""
    cost_fn: CostFn | None = None
    """`cost_fn(sample) -> tokens | (tokens, visual_tokens[, patches])`; default:
    `len(sample["input_ids"])`, which holds the expanded visual tokens, so a
    `sample["visual_tokens"]` only splits it, never adds (odb_core.torch.measure)."""
    cost_model: CostModel | CostKind | str = CostKind.PACKED
    """What a batch costs: a `CostModel`, or a `CostKind` or its value ('packed',
    'padded', 'attention', 'multimodal')."""
    oversize: OversizePolicy | str = OversizePolicy.ERROR
    """A sample above the budget: 'error' | 'solo' (a batch of its own) | 'truncate'
    (by `truncate_fn`)."""
    max_samples: int | None = None
    """At most this many samples per batch (None: no cap)."""
    max_patches: int | None = None
    """At most this many vision patches per batch (None: no cap)."""
    window_bytes: int | None = None
    """Join mode and static sharding (given, it makes the default sharding static):
    a bound on the tensor bytes of the preprocessed samples a rank holds in its
    window and formed batches; a window that reaches it emits its fullest batch
    before it takes another sample. Default `DEFAULT_WINDOW_BYTES` (1 GiB, which
    text-only windows never reach); 0: no bound. `epoch_stats.window_bytes_peak`
    and friends report what the loader held."""
    # Advanced
    buffer_size: int | None = None
    """The window a rank fills before forming batches, in samples; default 1,024
    under the padded cost model, 64 otherwise (`config.default_buffer_size`)."""
    former: FormerKind | str = FormerKind.SORT_WINDOW_GREEDY
    """The batch former (`odb_core.formers`)."""
    max_steps_per_round: int = 8
    """The most steps agreed per collective round (the all-gathered vector's size)."""
    early_form: int | None = None
    """Opt-in, join mode and static sharding: a rank whose training loop has no step
    waiting, whose next sample is not there yet, and whose window would take more
    than `early_form_wait` seconds to fill at the measured arrival rate, forms its
    partial window of at least `early_form` samples and emits its fullest batch;
    the source is then read on a thread (your dataset on it when num_workers=0).
    Batch composition then depends on when samples arrive: every sample is still
    emitted exactly once and every rank runs the same steps, but a run is not
    reproducible batch for batch, so it excludes deterministic=True."""
    early_form_wait: float = 0.25
    """Seconds a window may take to fill before an early form (`early_form`)."""

    def __post_init__(self) -> None:
        # The rest are checked by ProtocolConfig, which the loader builds from them.
        if self.early_form is not None:
            _count("early_form", self.early_form, least=1)
        if self.window_bytes is not None:
            _count("window_bytes", self.window_bytes)
        w = self.early_form_wait
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"early_form_wait={w!r} must be a finite number of seconds >= 0")


@dataclass(frozen=True)
class EpochOptions:
    """Which samples an epoch holds, in which order, on which rank."""

    shuffle: bool = False
    """Shuffle each epoch's order (seeded by `seed` and the epoch, the same on every rank)."""
    seed: int = 0
    """The seed of the per-epoch shuffle."""
    sampler: Sampler[Any] | Sequence[int] | None = None
    """The indices of an epoch, in order (map-style datasets; excludes shuffle=True)."""
    mode: Mode | str = Mode.JOIN
    """'join': every sample of the epoch in exactly one real batch on one rank (a rank
    with nothing left yields pad batches); 'quota': epochs close early, the ids not
    emitted carried into the next pass first (odb_core.ledger)."""
    quota: int | None = None
    """Quota mode: the samples an epoch emits (None: the dataset's length)."""
    deterministic: bool = False
    """A same-world-size resume is exact: it replays the interrupted protocol run and
    yields the very steps the uninterrupted run would have."""
    partition: bool = True
    """Split the dataset across ranks; False when it already yields this rank's shard."""
    id_fn: Callable[[Any], object] | None = None
    """`id_fn(sample) -> int`, the sample ids; default the dataset index, or the stream
    position for an IterableDataset."""
    sharding: Sharding | str | None = None
    """'static' | 'dynamic' (the core deals the epoch's indices each round to the
    ranks holding the least work; map-style, join or quota mode, resumed from the
    merged state of every rank, from the second epoch on priced by the costs the
    ranks observed); None: dynamic for a sized map-style dataset on more than one
    rank, static where dynamic cannot serve or an option needs static
    (`LoaderOptions.sharding`; `describe()` says which and why)."""

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
    """What the loss is normalised by, which tokens count, and the optimizer windows."""

    loss_normalization: LossNormalization | str = LossNormalization.TOKENS
    """'tokens' | 'samples': what a step's loss scale normalises by, over its window."""
    grad_accum_steps: int | None = None
    """Optimizer windows of G steps (at most one of this and `tokens_per_update`)."""
    tokens_per_update: int | None = None
    """Optimizer windows that close once their global loss tokens reach T."""
    loss_tokens_fn: LossTokensFn | None = None
    """`loss_tokens_fn(sample) -> int`, the tokens whose loss counts; default: the
    `labels[label_shift:] != ignore_index` of a sample with `labels`, else all its
    text tokens."""
    label_shift: int = 1
    """How far the labels are shifted against the inputs (0 for an encoder-decoder)."""
    ignore_index: int = -100
    """The label value whose loss does not count."""
    truncate_fn: TruncateFn | None = None
    """How `oversize='truncate'` cuts a sample to the budget."""

    def __post_init__(self) -> None:
        _count("label_shift", self.label_shift)
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ConfigError(f"ignore_index={self.ignore_index!r} must be an integer")
        if self.loss_tokens_fn is not None and not callable(self.loss_tokens_fn):
            raise ConfigError(f"loss_tokens_fn={self.loss_tokens_fn!r} is not callable")


@dataclass(frozen=True)
class OutputOptions:
    """What each iteration yields."""

    collate_fn: Callable[[list[Any]], Any] | None = None
    """Builds each batch from its samples (default: torch's `default_collate`)."""
    step_meta: bool = True
    """Carry the step's metadata in the batch under `"odb_step"`; False: yield exactly
    collate_fn's output."""
    with_step_info: bool = False
    """Yield `(batch, step_info)`."""
    trace_dir: str | Path | None = None
    """Record the protocol trace of every epoch there (odb_core.trace)."""

    def __post_init__(self) -> None:
        for name in ("step_meta", "with_step_info"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a bool")

    @property
    def collate(self) -> Callable[[list[Any]], Any]:
        """`collate_fn`, or torch's `default_collate` when None."""
        return self.collate_fn if self.collate_fn is not None else default_collate

    @property
    def trace_path(self) -> Path | None:
        """`trace_dir` as a Path (None: no trace)."""
        return None if self.trace_dir is None else Path(self.trace_dir)


@dataclass(frozen=True)
class WorkerOptions:
    """The inner torch DataLoader's workers (DataLoader's own arguments) and the prefetch."""

    num_workers: int = 0
    """As in DataLoader."""
    pin_memory: bool = False
    """As in DataLoader (warns and pins nothing without an accelerator)."""
    timeout: float = 0
    """As in DataLoader."""
    worker_init_fn: Callable[[int], None] | None = None
    """As in DataLoader (called after the worker is tied to its rank)."""
    multiprocessing_context: Any = None
    """As in DataLoader."""
    generator: Any = None
    """As in DataLoader."""
    prefetch_factor: int | None = None
    """As in DataLoader."""
    persistent_workers: bool = False
    """As in DataLoader."""
    pin_memory_device: str = ""
    """As in DataLoader."""
    # Advanced
    samples_per_fetch: int = 8
    """Samples per worker round trip."""
    prefetch_thread: bool = True
    """Form batches on a background thread, ahead of the training loop; False runs
    everything (your dataset included when num_workers=0) in the thread that
    iterates, e.g. to debug it."""

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
    """Seconds before a dead or hung peer raises ODBPeerError."""

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

    def protocol_config(self, world_size: int, sharding: Sharding) -> ProtocolConfig:
        """The core's `ProtocolConfig` of these options, on `world_size` ranks under
        `sharding` (and the window's byte bound that goes with it: `window_bound`);
        ProtocolConfig checks what these options leave to it (ConfigError)."""
        b, e, loss = self.batch, self.epoch, self.loss
        model = b.cost_model
        if isinstance(model, (str, CostKind)):
            model = make_cost_model(model)
        return ProtocolConfig(
            world_size=world_size,
            budget=Budget(b.token_budget, b.max_samples, b.max_patches),
            cost_model=model,
            buffer_size=default_buffer_size(model) if b.buffer_size is None else b.buffer_size,
            mode=coerce_enum(Mode, "mode", e.mode),
            former=coerce_enum(FormerKind, "former", b.former),
            oversize=coerce_enum(OversizePolicy, "oversize policy", b.oversize),
            max_steps_per_round=b.max_steps_per_round,
            quota=e.quota,
            deterministic=e.deterministic,
            loss_normalization=coerce_enum(
                LossNormalization, "loss normalization", loss.loss_normalization
            ),
            grad_accum_steps=loss.grad_accum_steps,
            tokens_per_update=loss.tokens_per_update,
            sharding=sharding,
            early_form=b.early_form,
            window_bytes=self.window_bound(sharding),
        )

    def check_placement(self, *, dynamic: bool, iterable: bool, world: int) -> None:
        """The checks that need the sharding in force and the world: dynamic sharding
        deals dataset indices, and partition=False needs ids unique across ranks."""
        e = self.epoch
        if dynamic and (iterable or e.id_fn is not None or not e.partition):
            raise ConfigError(
                "sharding='dynamic' deals dataset indices to ranks each round; it needs a "
                "map-style dataset whose ids are its indices and partition=True (got "
                f"iterable={iterable}, id_fn={e.id_fn!r}, partition={e.partition!r})"
            )
        if not iterable and not e.partition and world > 1 and e.sampler is None and e.id_fn is None:
            raise ConfigError(
                "partition=False means each rank's dataset is already its own shard, so its "
                "indices 0..n-1 are not unique across ranks; pass id_fn= (a global id per "
                "sample) or a sampler of indices disjoint across ranks"
            )

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


OPTION_DEFAULTS: dict[str, Any] = {
    **{f.name: f.default for g in _GROUPS.values() for f in fields(g) if f.name != "token_budget"},
    "peer_timeout": LoaderOptions.peer_timeout,
}
"""Every `ODBDataLoader` option's default (all but `token_budget`, which has none)."""
