"""ODBDataLoader: a drop-in `torch.utils.data.DataLoader` with token-budget batches
formed after preprocessing and every rank step-aligned by the DGAP protocol.

The loader does I/O only. An inner `DataLoader(batch_size=None)` over the user's
dataset (public API, any start method, persistent workers or not) feeds
processed samples; the per-rank `RankMachine` decides every batch, step count,
pad, global count, loss scale and the end of the epoch; one gloo all-gather per
round moves the machine's vector; the user's `collate_fn` builds each batch.

Every yielded batch carries its step metadata in band (`odb_step`, see meta.py);
steps are yielded once their optimizer window has closed (odb_core.window), so
every step's loss scale normalises by its whole window. Iterating again after a
completed epoch starts the next one. With `deterministic=True` a same-world-size
resume is exact: it replays the interrupted protocol run and yields the very
steps the uninterrupted run would have.

Quota mode carries over (see odb_core.ledger): the ids a closed epoch did not
emit (its ledger, gathered from every rank in one collective at the close) are
the first samples of the next pass, dealt round-robin over the ranks, and are
removed from that pass's normal split, so no id appears twice in a pass and none
is dropped. `loader.ledger` / `loader.carried_count` report what the last closed
epoch carried (`loader.ledger_ages`: for how many passes in a row each id has
been carried), `loader.carried_in` what the current pass started with; the core
forms those ahead of fresh samples, so each is emitted in that pass (see
proofs/cross_epoch_fairness.md for the hypotheses); a log
line on the `odb_core` logger says it too. The pending carry is part of
`state_dict()`. A pass that does not close (the loop broke out early) leaves the
pending carry as it was.
"""

from __future__ import annotations

import array
import functools
import json
import logging
import math
import os
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Sampler
from torch.utils.data import default_collate as _default_collate

from odb_core.assign import initial_slice
from odb_core.config import (
    LossNormalization,
    Mode,
    OversizePolicy,
    ProtocolConfig,
    Sharding,
    default_buffer_size,
    make_cost_model,
)
from odb_core.cost import Budget, CostKind, CostModel
from odb_core.cost_table import CostTable
from odb_core.epoch import EpochTracker
from odb_core.errors import ConfigError, EpochFinishedError, ODBError, ResumeStateError
from odb_core.estimate import StepsEstimate
from odb_core.formers import FormerKind
from odb_core.ledger import Ledgers, ages, ledger_ids, rank_order, without
from odb_core.progress import RunProgress
from odb_core.protocol import RankMachine, StepInfo
from odb_core.resume import (
    EpochProgress,
    ResumeClaim,
    ResumeReport,
    check_claims,
    fingerprint_mismatch,
    merge,
    partition,
)
from odb_core.sample import Sample
from odb_core.schedule import SampleProfile
from odb_core.torch.length import EpochLength, shard_sizes
from odb_core.torch.lookahead import LookAhead
from odb_core.torch.measure import CostFn, LossTokens, LossTokensFn, TruncateFn, measure
from odb_core.torch.meta import scaled_loss
from odb_core.torch.options import LoaderOptions, ShardingChoice
from odb_core.torch.pipeline import EpochPipeline
from odb_core.torch.rounds import Emitted, EpochSetup, EpochStats, _End
from odb_core.torch.sharding import epoch_order, sampler_order
from odb_core.torch.source import (
    IndexChunks,
    IterSource,
    LoadFailure,
    MapSource,
    SampleLoadError,
    WorkerGuard,
    identity,
)
from odb_core.torch.state import fingerprint, resume_target
from odb_core.torch.trainer_checks import check_trainer_context
from odb_core.torch.transport import (
    GlooTransport,
    LocalTransport,
    Transport,
    announce_construction_error,
    next_loader_seq,
)
from odb_core.trace import TracingRankMachine

__all__ = ["ODBDataLoader"]

log = logging.getLogger("odb_core")

_RESUME_TAG = -2  # marks the resume check's collective (order digests are >= 0)
# (epoch, length, shuffle, seed), the epoch order, (progress, world, rank) it was
# checked for, and that rank's remaining ids (see _checked_state).
# What a loaded state resumes under: config, fingerprint, digest, sharding choice.
_Identity = tuple[ProtocolConfig, dict[str, Any], int, ShardingChoice]
_LoadedOrder = tuple[
    tuple[int, int, bool, int], Sequence[int], tuple[EpochProgress, int, int], list[int] | None
]


def _announce_failure(init: Callable[..., None]) -> Callable[..., None]:
    """Under torch.distributed, a loader whose construction fails on one rank tells
    the others, which wait for it before creating the gloo group (transport.py)."""

    @functools.wraps(init)
    def wrapped(self: ODBDataLoader, *args: Any, **kwargs: Any) -> None:
        self._odb_seq = next_loader_seq()
        try:
            init(self, *args, **kwargs)
        except Exception as exc:
            announce_construction_error(self._odb_seq, exc)
            raise

    return wrapped


class ODBDataLoader:
    """Token-budget batches, formed after preprocessing, step-aligned across ranks.

    Swap `DataLoader(ds, batch_size=8, ...)` for `ODBDataLoader(ds, token_budget=...)`.
    Iterating yields what `collate_fn` returns plus the step's metadata under
    `"odb_step"` (`pop_step_meta(batch)` takes it out; `scaled_loss` /
    `causal_lm_loss` scale the loss); `loader.step_info` is the `StepInfo` of the
    last batch yielded, which a prefetching trainer may already have moved past.
    Under torch.distributed every rank yields the same number of batches per
    epoch; in join mode (default) every sample of the epoch is in exactly one real
    batch on one rank, and a rank with nothing left yields pad batches
    (`step_info.is_pad`, loss scale 0).

    Arguments beyond DataLoader's: `token_budget` (per batch, under `cost_model`: a
    `CostModel`, or a `CostKind` or its value, e.g. 'packed' or 'padded'),
    `cost_fn(sample) -> tokens | (tokens, visual_tokens[, patches])` (default:
    `len(sample["input_ids"])`, which holds the expanded visual tokens, so a
    `sample["visual_tokens"]` only splits it, never adds: odb_core.torch.measure),
    `mode` ('join' | 'quota'), `quota`, `seed` (per-epoch shuffle, same on every
    rank), `peer_timeout` (seconds before a dead or hung peer raises
    ODBPeerError), `buffer_size` (window per rank; default 1,024 samples under the
    padded cost model, 64 otherwise), `max_steps_per_round`,
    `former`, `oversize` ('error' | 'solo' | 'truncate'), `max_samples`,
    `max_patches`, `loss_normalization` ('tokens' | 'samples'), `deterministic`,
    `partition` (split the dataset across ranks; False when it already yields
    this rank's shard), `id_fn(sample) -> int` (sample ids; default the dataset
    index, or the stream position for an IterableDataset), `truncate_fn`,
    `with_step_info` (yield `(batch, step_info)`), `trace_dir` (record the
    protocol trace of every epoch), `samples_per_fetch` (samples per worker
    round trip), `prefetch_thread` (form batches on a background thread, ahead of
    the training loop; False runs everything, your dataset included when
    num_workers=0, in the thread that iterates, e.g. to debug it),
    `loss_tokens_fn(sample) -> int` (tokens whose loss counts; default: the
    `labels[label_shift:] != ignore_index` of a sample with `labels`, else all its
    text tokens), `grad_accum_steps` / `tokens_per_update` (optimizer windows:
    every G steps, or once the window's global loss tokens reach T), `step_meta`
    (False: yield exactly collate_fn's output, without the `odb_step` key),
    `sharding` ('static' | 'dynamic': the core deals the epoch's indices each round
    to the ranks holding the least work; map-style, join or quota mode (the ledger
    is dealt first in the next pass), resumed from the merged state of every rank,
    from the second epoch on priced by the costs the ranks observed (`cost_table`);
    unset: dynamic for a sized map-style dataset on more than one rank, static where
    dynamic cannot serve or an option needs static; `describe()` says which and why),
    `early_form` / `early_form_wait` (opt-in, join mode
    and static sharding: a rank whose training loop has no step waiting, whose next
    sample is not there yet, and whose window would take more than
    `early_form_wait` seconds (default 0.25) to fill at the measured arrival rate,
    forms its partial window of at least `early_form` samples and emits its
    fullest batch; the source is then read on a thread,
    your dataset on it when num_workers=0. Batch composition then depends on
    when samples arrive: every sample is still emitted exactly once and every rank
    runs the same steps, but a run is not reproducible batch for batch, so it
    excludes deterministic=True), `window_bytes` (join mode and static sharding;
    given, it makes the default sharding static:
    a bound on the tensor bytes of the preprocessed samples a rank holds in its
    window and formed batches; a window that reaches it emits its fullest batch
    before it takes another sample; default `DEFAULT_WINDOW_BYTES`, 1 GiB, which
    text-only windows never reach; 0: no bound; `epoch_stats.window_bytes_peak`
    and friends report what the loader held).
    """

    _odb_seq = 0  # which loader of this process (set by _announce_failure)
    _sharding: ShardingChoice

    @_announce_failure
    def __init__(
        self,
        dataset: Any,
        *,
        token_budget: float,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        cost_fn: CostFn | None = None,
        cost_model: CostModel | CostKind | str = CostKind.PACKED,
        mode: Mode | str = Mode.JOIN,
        quota: int | None = None,
        seed: int = 0,
        peer_timeout: float = 300.0,
        buffer_size: int | None = None,
        max_steps_per_round: int = 8,
        former: FormerKind | str = FormerKind.SORT_WINDOW_GREEDY,
        oversize: OversizePolicy | str = OversizePolicy.ERROR,
        max_samples: int | None = None,
        max_patches: int | None = None,
        early_form: int | None = None,
        early_form_wait: float = 0.25,
        window_bytes: int | None = None,
        loss_normalization: LossNormalization | str = LossNormalization.TOKENS,
        deterministic: bool = False,
        shuffle: bool = False,
        sampler: Sampler[Any] | Sequence[int] | None = None,
        partition: bool = True,
        id_fn: Callable[[Any], object] | None = None,
        truncate_fn: TruncateFn | None = None,
        with_step_info: bool = False,
        loss_tokens_fn: LossTokensFn | None = None,
        label_shift: int = 1,
        ignore_index: int = -100,
        grad_accum_steps: int | None = None,
        tokens_per_update: int | None = None,
        step_meta: bool = True,
        trace_dir: str | Path | None = None,
        samples_per_fetch: int = 8,
        prefetch_thread: bool = True,
        sharding: Sharding | str | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        batch_size: object = None,
        batch_sampler: object = None,
        drop_last: bool = False,
    ) -> None:
        # Every keyword argument, grouped and checked in one place before anything
        # is applied (torch/options.py).
        args = {k: v for k, v in locals().items() if k not in ("self", "dataset")}
        self.options = LoaderOptions.of(**args)
        iterable = self.options.check_dataset(dataset)

        self.dataset = dataset
        self.transport: Transport = self._make_transport(peer_timeout)
        self.rank = self.transport.rank
        self.world_size = self.transport.world_size
        self._sharding = self.options.sharding(iterable=iterable, world=self.world_size)
        if isinstance(cost_model, (str, CostKind)):
            cost_model = make_cost_model(cost_model)
        self.config = ProtocolConfig(
            world_size=self.world_size,
            budget=Budget(token_budget, max_samples, max_patches),
            cost_model=cost_model,
            buffer_size=default_buffer_size(cost_model) if buffer_size is None else buffer_size,
            mode=mode,  # type: ignore[arg-type]  # coerced and validated by ProtocolConfig
            former=former,  # type: ignore[arg-type]
            oversize=oversize,  # type: ignore[arg-type]
            max_steps_per_round=max_steps_per_round,
            quota=quota,
            deterministic=deterministic,
            loss_normalization=loss_normalization,  # type: ignore[arg-type]
            grad_accum_steps=grad_accum_steps,
            tokens_per_update=tokens_per_update,
            sharding=self._sharding.sharding,
            early_form=early_form,
            window_bytes=self.options.window_bound(self._sharding.sharding),
        )
        if self.config.dynamic and (iterable or id_fn is not None or not partition):
            raise ConfigError(
                "sharding='dynamic' deals dataset indices to ranks each round; it needs a "
                "map-style dataset whose ids are its indices and partition=True (got "
                f"iterable={iterable}, id_fn={id_fn!r}, partition={partition!r})"
            )
        if (
            not iterable
            and not partition
            and self.world_size > 1
            and sampler is None
            and id_fn is None
        ):
            raise ConfigError(
                "partition=False means each rank's dataset is already its own shard, so its "
                "indices 0..n-1 are not unique across ranks; pass id_fn= (a global id per "
                "sample) or a sampler of indices disjoint across ranks"
            )

        self.collate_fn = collate_fn if collate_fn is not None else _default_collate
        self.cost_fn = cost_fn
        self.id_fn = id_fn
        self.truncate_fn = truncate_fn
        self.loss_tokens = LossTokens(loss_tokens_fn, label_shift, ignore_index)
        self.step_meta = step_meta
        self.seed = seed
        self.shuffle = shuffle
        self.sampler = sampler
        self.partition = partition
        self.with_step_info = with_step_info
        self.trace_dir = None if trace_dir is None else Path(trace_dir)
        self.num_workers = num_workers
        self.prefetch_thread = bool(prefetch_thread)
        self.persistent_workers = persistent_workers
        self.early_form_wait = float(early_form_wait)
        self._iterable = iterable
        self._pin = self._make_pin(pin_memory, pin_memory_device)
        self._index_sampler: IndexChunks | None = None
        self._plan: tuple[int, ...] = ()  # dynamic sharding: this epoch's plan
        # Dynamic sharding: the costs observed in the last closed epoch, which price
        # the next deals (odb_core.cost_table); None: priced at the mean.
        self._cost_table: CostTable | None = None
        # What the current epoch's close learned: in force from the next epoch on.
        self._learned: CostTable | None = None
        self._guard = WorkerGuard(worker_init_fn)
        if iterable:
            source: Any = IterSource(
                dataset, self.rank, self.world_size, partition, samples_per_fetch
            )
        else:
            source = MapSource(dataset)
            self._index_sampler = IndexChunks(samples_per_fetch)
        self._inner = DataLoader(
            source,
            batch_size=None,
            sampler=self._index_sampler,
            num_workers=num_workers,
            collate_fn=identity,
            pin_memory=False,
            timeout=timeout,
            worker_init_fn=self._guard,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
        )
        self._fingerprint, self._digest = self._identity_of(self.config)
        digest_src = json.dumps(self._fingerprint, sort_keys=True, default=str)
        # Every argument is valid here: only now meet the peers (a ConfigError on any
        # rank reaches all of them) and create the gloo group.
        connect = getattr(self.transport, "connect", None)
        if callable(connect):
            connect(json.loads(digest_src), getattr(self, "_odb_seq", None))
        self._guard.inodes = getattr(self.transport, "socket_inodes", frozenset())
        self._lock = threading.Lock()
        self._pipeline: EpochPipeline | None = None
        self._iteration = 0
        self._workers_started = False
        self._resume: EpochProgress | None = None
        # The loader as it was before a load not yet checked across ranks (and
        # whether the last load was refused): see _verify_resume.
        self._unverified: tuple[Any, ...] | None = None
        self._refused = False
        # What load_state_dict computed to check the state, kept for the first
        # iteration after it: (epoch, dataset length, shuffle, seed), the epoch order,
        # and the progress it checked with this rank's remaining ids (or None).
        self._loaded_order: _LoadedOrder | None = None
        self.epoch = 0
        # The current epoch completed (iterated to its end, or loaded closed) and no
        # set_epoch since: the next iter() starts epoch + 1.
        self._advance = False
        # What the last load_state_dict resumed from (None before any).
        self.resume_report: ResumeReport | None = None
        self._serial = 0  # bumped by set_epoch / load_state_dict: older iterators stop counting
        self.step_info: StepInfo | None = None
        # Where this rank is in the epoch, step by step (odb_core.epoch); the pending
        # carry (into the running pass, or out of a closed one) is its position's.
        self._tracker = EpochTracker()
        self.ledgers: Ledgers = ()  # per rank, of the last closed epoch
        self.ledger: tuple[int, ...] = ()  # all ranks' ids not emitted by the last closed epoch
        self.carried_in: tuple[int, ...] = ()  # ids the current pass started with
        # Each id of `ledger`: the passes in a row it has been carried (odb_core.ledger.ages).
        self.ledger_ages: dict[int, int] = {}
        self.epoch_stats: EpochStats | None = None  # of the last finished epoch
        self._length = EpochLength(self.config)
        self._reset_progress()
        if self.rank == 0:
            d = self.describe()
            log.info(
                "odb: sharding=%s (%s); window_bytes=%s (%s)",
                d["sharding"],
                d["sharding_reason"],
                d["window_bytes"],
                d["window_bytes_reason"],
            )

    def describe(self) -> dict[str, Any]:
        """What is in force, as plain data: the protocol config (`ProtocolConfig.
        describe()`), the sharding and why (`sharding=` given, or the default: dynamic
        for a sized map-style dataset, static where dynamic cannot serve or an option
        needs static: `LoaderOptions.sharding`), and the window's byte bound and why
        (by default only where static sharding is in force, in join mode)."""
        c, b = self.config, self.options.batch
        if c.window_bytes is not None:
            why = "given" if b.window_bytes else "default under join mode and static sharding"
        elif b.window_bytes == 0:
            why = "window_bytes=0 given: no bound"
        else:
            why = "no bound: join mode and static sharding only"
        return {
            **c.describe(),
            "sharding": c.sharding.value,
            "sharding_reason": self._sharding.reason,
            "window_bytes": c.window_bytes,
            "window_bytes_reason": why,
            "world_size": self.world_size,
        }

    def _identity_of(self, config: ProtocolConfig) -> tuple[dict[str, Any], int]:
        """The fingerprint a state saved under `config` carries, and its digest (the
        tag of every collective of the loader)."""
        o, e = self.options, self.options.epoch
        fp = fingerprint(
            self.dataset,
            config,
            kind="iterable" if self._iterable else "map",
            length=None if self._iterable else len(self.dataset),
            seed=e.seed,
            shuffle=e.shuffle,
            partition=e.partition,
            sampler=e.sampler,
        )
        fp["id_fn"] = e.id_fn is not None
        fp["loss_tokens_fn"] = o.loss.loss_tokens_fn is not None
        fp["label_shift"] = o.loss.label_shift
        fp["ignore_index"] = o.loss.ignore_index
        return fp, zlib.crc32(json.dumps(fp, sort_keys=True, default=str).encode())

    def _config_for(self, sharding: Sharding) -> ProtocolConfig:
        """This loader's config under `sharding` (and the byte bound that goes with it)."""
        return replace(
            self.config,
            sharding=sharding,
            window_bytes=self.options.window_bound(sharding),
        )

    # ---- DataLoader surface ------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        check_trainer_context(self)
        with self._lock:
            self._stop_pipeline()
            self._check_world()
            if self._unverified is not None:
                self._verify_resume()
            if self._advance:
                self._next_epoch()
            if self._learned is not None:  # a closed epoch taught it: the next pass's
                self._cost_table, self._learned = self._learned, None
            self._iteration += 1
            progress = self._resume if self._resume and self._resume.epoch == self.epoch else None
            self._resume = None
            self._reset_progress(progress)
            self.step_info = None
            # Where this protocol run starts: the epoch's start, the saved step (a
            # resume that keeps exactly-once), or, for an exact resume, the start of
            # the run the state was saved from, which it replays.
            run = self._tracker.plan(progress, exact=progress is not None and self._exact(progress))
            plan, skip_before, replay_ids = run.plan, run.skip_before, run.replay_ids
            step0, emitted0, window0 = run.start
            config = self.config
            if progress is not None and config.quota is not None:
                left = config.quota - emitted0
                if left <= 0:
                    self._tracker.close()
                else:
                    config = replace(config, quota=left)
            if self._tracker.position.closed:
                return iter(())
            excluded = self._excluded(plan)
            self.carried_in = ledger_ids(self._carry)
            if self.carried_in:
                # The core forms the carried ids ahead of fresh ones (bounded carry).
                config = replace(config, carried=frozenset(self.carried_in))
            shard, order_digest = self._start_source(plan, excluded, step0)
            if config.dynamic:
                config = replace(config, plan=self._plan, cost_table=self._pricing_table())
            machine_cls = RankMachine if self.trace_dir is None else TracingRankMachine
            trace_path = None
            if self.trace_dir is not None:
                trace_path = self.trace_dir / (
                    f"trace-epoch{self.epoch}-step{step0}-rank{self.rank}.json"
                )
            self._guard.owner = os.getpid()
            self._guard.inodes = getattr(self.transport, "socket_inodes", frozenset())
            setup = EpochSetup(
                machine=machine_cls(self.rank, config),
                transport=self.transport,
                source=self._source_iterator(config),
                tag=(self._digest, order_digest, self._iteration),
                excluded=excluded,
                step_offset=step0,
                collate=self.collate_fn,
                cost_fn=self.cost_fn,
                loss_tokens=self.loss_tokens,
                id_fn=self.id_fn,
                truncate_fn=self.truncate_fn,
                pin=self._pin,
                pad_fallback=functools.partial(_pad_fallback, self.dataset, self.rank),
                shard=shard if self.id_fn is None else None,
                trace_path=trace_path,
                window_offset=window0,
                step_meta=self.step_meta,
                skip_before=skip_before,
                replay_ids=replay_ids,
                # Not a bound method: the pipeline must not hold the loader (a cycle
                # only the cyclic GC frees, which keeps a dropped iterator's workers).
                restart=functools.partial(_restart_source, self._index_sampler, self._inner)
                if config.dynamic and self._index_sampler is not None
                else None,
                early_form_wait=self.early_form_wait if config.early_form else None,
                fetch=self.options.workers.samples_per_fetch,
                table_size=len(self.dataset) if config.dynamic else None,
            )
            self._workers_started = self.num_workers > 0
            self._pipeline = EpochPipeline(setup, threaded=self.prefetch_thread)
            self._pipeline.start()
            return _EpochIterator(self, self._pipeline, self._serial)

    def __len__(self) -> int:
        """An upper estimate of an epoch's steps, for progress bars: the estimate made
        before any epoch ran (`planned_steps().upper`), so it does not change between
        epochs for the same data, seed policy and world size. The real count is
        decided online and may exceed it: never cut an epoch at len(), and drive an
        LR schedule by `run_progress` (`odb_core.torch.ProgressLR`)."""
        return self.planned_steps().upper

    def planned_steps(self) -> StepsEstimate:
        """The estimate of an epoch's steps made before any epoch ran (fixed for the
        loader's life; `steps_estimate()` refines it with the realised counts)."""
        self.steps_estimate()
        planned = self._length.planned
        assert planned is not None
        return planned

    @property
    def run_progress(self) -> RunProgress:
        """How much of the run is done, as of the last batch yielded (or a loaded
        state not yet iterated): the samples and loss tokens of the epoch's closed
        optimizer windows, the windows closed, out of the samples an epoch
        consumes; the same on every rank. `run_progress.fraction(epochs)` is the
        clock of `ProgressLR`."""
        pending = self._resume
        if pending is not None and pending.epoch == self.epoch:
            return RunProgress(
                epoch=self.epoch,
                epoch_samples=self.epoch_samples,
                samples=pending.emitted,
                updates=pending.window,
                closed=pending.closed,
            )
        return self._tracker.run_progress(self.epoch, self.epoch_samples)

    def progress_after(self, step: int | None) -> RunProgress:
        """`run_progress` as of step `step` of the current pass (one of the last few
        yielded; None: before its first), for a trainer that prefetches batches."""
        return self._tracker.progress.after(step, self.epoch, self.epoch_samples)

    @property
    def epoch_samples(self) -> int:
        """The samples one epoch consumes, all ranks together (0 when unknown: an
        IterableDataset, or partition=False): the dataset's (or the sampler's)
        length, capped by the quota in quota mode."""
        if self._iterable or not self.partition:
            return 0
        source = self.sampler if self.sampler is not None else self.dataset
        if not hasattr(source, "__len__"):
            return 0
        n = len(source)
        quota = self.config.quota if self.config.mode is Mode.QUOTA else None
        return n if quota is None else min(n, quota)

    def sample_profile(self) -> SampleProfile:
        """Mean cost and loss tokens per sample of the dataset, from the same seeded
        sample of measured samples as the step estimate (map-style datasets only)."""
        self.steps_estimate()
        return SampleProfile.of(self._length.costs)

    def steps_estimate(self) -> StepsEstimate:
        """The estimated steps of the current (or next) epoch, the same on every rank:
        the core's former run on bootstrap draws of 256 measured samples (read once,
        the first time this is asked), refined by the realised counts of finished
        epochs (`epoch_steps`). Map-style datasets only."""
        if self._iterable:
            raise TypeError(
                "ODBDataLoader over an IterableDataset has no length estimate: the stream's "
                "size is unknown before it ends (the realised counts are in epoch_steps)"
            )
        size = len(self.dataset)

        def measure_one(i: int) -> Any:
            return measure(self.dataset[i], i, self.cost_fn, self.loss_tokens)

        return self._length.estimate(size, shard_sizes(size, self.world_size), measure_one)

    @property
    def measured_samples(self) -> list[Sample]:
        """The measured samples the step estimate drew (`steps_estimate`; empty
        before it ran): what estimates of part of an epoch are formed from."""
        return self._length.costs

    @property
    def epoch_steps(self) -> dict[int, int]:
        """Realised aligned steps of each finished epoch (the same on every rank)."""
        return dict(self._length.realised)

    def set_epoch(self, epoch: int, *, repeat: bool = False) -> None:
        """Select the epoch (its shuffle order); call it on every rank, as with
        DistributedSampler. Forwarded to the dataset and sampler if they have one.

        Without it, iterating again after a completed epoch starts the next one, as
        does iterating after loading a state saved at an epoch's end. Naming an
        epoch that has completed (the one just finished, or an earlier one) raises
        `EpochFinishedError`, unless `repeat=True` says to train it again."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch={epoch!r} must be a non-negative integer")
        if self._advance and epoch <= self.epoch:
            if not repeat:
                raise EpochFinishedError(epoch, self.epoch)
            if self._resume is not None and self._resume.closed:
                self._resume = None
            self._reset_progress()
        self._serial += 1
        self._advance = False
        if self._resume is not None and self._resume.epoch != epoch:
            if not self._resume.closed:
                warnings.warn(
                    f"set_epoch({epoch}) discards the loaded state of epoch "
                    f"{self._resume.epoch} (stopped at step {self._resume.step})",
                    stacklevel=2,
                )
            self._resume = None
        if epoch != self.epoch:
            self._reset_progress()
        self.epoch = epoch
        self._forward_epoch(epoch, stacklevel=3)

    def _forward_epoch(self, epoch: int, stacklevel: int) -> None:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            if self._workers_started and self.persistent_workers:
                warnings.warn(
                    "persistent_workers=True: the dataset copies in the running workers do "
                    "not see set_epoch (a DataLoader limitation); only the main process copy "
                    "is updated",
                    stacklevel=stacklevel,
                )
            set_epoch(epoch)

    def _next_epoch(self) -> None:
        """The epoch completed and set_epoch was not called since: start the next."""
        done = self.epoch
        self._advance = False
        self._resume = None
        self.epoch = done + 1
        self._reset_progress()
        log.info(
            "odb: rank %d: epoch %d completed; iterating again starts epoch %d (call "
            "set_epoch(e) to choose the epoch)",
            self.rank,
            done,
            self.epoch,
        )
        self._forward_epoch(self.epoch, stacklevel=4)

    @property
    def carried_count(self) -> int:
        """How many samples the last closed epoch carried into the next (all ranks)."""
        return len(self.ledger)

    # ---- step info -----------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Deprecated: `odb_core.scaled_loss(loader.step_info, loss)`."""
        warnings.warn(
            "ODBDataLoader.scale_loss(loss) is deprecated: use "
            "odb_core.scaled_loss(meta, loss) (meta = pop_step_meta(batch), or loader.step_info)",
            DeprecationWarning,
            stacklevel=2,
        )
        if self.step_info is None:
            raise ODBError("scale_loss() before the first batch of the epoch was yielded")
        return scaled_loss(self.step_info, loss)

    # ---- facts for trainers ----------------------------------------------------

    @property
    def epoch_closed(self) -> bool:
        """Whether the current epoch has closed: the batch just yielded was its last
        (known as it is yielded, no lookahead), or the loaded state was saved at its end."""
        if self._resume is not None:
            return self._resume.closed
        return self._tracker.position.closed

    def step_bound(self) -> int | None:
        """A number of steps no epoch reaches (one step per sample of the dataset),
        for a trainer loop that needs a per-epoch cap; None for an IterableDataset."""
        source = self.sampler if self.sampler is not None else self.dataset
        if self._iterable or not hasattr(source, "__len__"):
            return None
        n = len(source)
        return n + 1 if self.partition else n * self.world_size + 1

    def optimizer_steps(self, steps: int) -> int:
        """The optimizer steps (windows) of an epoch of `steps` steps: ceil(steps / G)
        with grad_accum_steps=G, `steps` with tokens_per_update (a window is at least
        one step); e.g. `optimizer_steps(len(loader))` sizes a schedule."""
        if self.config.tokens_per_update is not None:
            return int(steps)
        return math.ceil(int(steps) / (self.config.grad_accum_steps or 1))

    # ---- resumable state -----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain data: where this rank is in the epoch. Taken after a batch, a resume
        continues with the next one; every sample of the epoch is still emitted
        exactly once. Load it on the same rank at the same world size, or load the
        list of every rank's state (same step) at any world size.

        With `deterministic=True`, loading this rank's own state at the same world
        size resumes *exactly*: the same steps, batches, pads and windows as the
        uninterrupted run from the saved step on (the epoch's protocol run is
        replayed from its start on every rank without collating the steps before
        the saved one, so the samples done are read again)."""
        if self._resume is not None:
            return self._with_table(self._resume.to_dict())
        return self._with_table(self._tracker.current(**self._identity()).to_dict())

    def state_after(self, step: int | None) -> dict[str, Any]:
        """`state_dict()` as of step `step` of the current pass, one of the last few
        yielded (None: before the pass's first), for a trainer that prefetches
        batches: a resume from it continues with step `step + 1`."""
        if self._resume is not None:  # loaded, not iterated yet
            return self._with_table(self._resume.to_dict())
        return self._with_table(self._tracker.after(step, **self._identity()).to_dict())

    @property
    def cost_table(self) -> CostTable | None:
        """The learned cost table the next deals are priced by (dynamic sharding:
        what the ranks observed in the last closed epoch, or what a loaded state
        carried); None: priced at the gathered mean."""
        return self._learned if self._learned is not None else self._cost_table

    def _with_table(self, state: dict[str, Any]) -> dict[str, Any]:
        """A state with the learned cost table the next deals are priced by (dynamic
        sharding; absent when there is none: a resume then prices at the mean)."""
        table = self._cost_table
        if state.get("closed") and self._learned is not None:
            table = self._learned  # a closed state resumes with the next epoch
        if table is not None:
            state[_TABLE_KEY] = table.to_state()
        return state

    def _identity(self) -> dict[str, Any]:
        return {
            "fingerprint": self._fingerprint,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Resume from `state_dict()` (this rank's) or a list of every rank's states.

        The state is checked before anything is applied (schema, version, checksum,
        this dataset and config, internal consistency: `ResumeStateError`), and, in
        one collective at the first iteration after the load, against what every
        other rank loaded (`ResumeMismatchError` on every rank, the load undone)."""
        try:
            table = self._checked_table(state)
            progress, identity = self._checked_state(_without_table(state))
        except ConfigError:
            with self._lock:
                # Nothing applied; the first iteration still tells the peers.
                if self._unverified is None:
                    self._unverified = self._snapshot()
                self._refused = True
            raise
        with self._lock:
            self._stop_pipeline()
            if self._unverified is None:
                self._unverified = self._snapshot()
            self._refused = False
            self._serial += 1
            self._set_identity(identity)
            self._cost_table, self._learned = table, None
            self._resume = progress
            self._carry = progress.carry
            self.epoch = progress.epoch
            # A state taken after the epoch's last batch: the epoch completed, so
            # iterating starts the next one, as it would have in the saved run.
            self._advance = progress.closed
            self.resume_report = ResumeReport.of(progress, self.world_size)

    # ---- internals -------------------------------------------------------------

    def _checked_state(
        self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> tuple[EpochProgress, _Identity]:
        if isinstance(state, Mapping):
            progress = EpochProgress.from_dict(state)
        elif isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
            progress = merge(EpochProgress.from_dict(s) for s in state)
        else:
            raise ResumeStateError(
                f"load_state_dict expects a state dict or a list of them, got {state!r}"
            )
        identity = self._identity_for(progress)
        config = identity[0]
        # One rank's state of a one-rank run is the whole run's.
        if config.dynamic and not progress.is_global and progress.world_size != 1:
            raise ResumeStateError(
                f"this loader deals ids by dynamic sharding ({identity[3].reason}), which "
                f"resumes from every rank's state, merged (load_state_dict([s0, s1, ...]), "
                f"or gather_states/load_states), not rank {progress.rank}'s alone: its done "
                "ids are not the run's; pass sharding='static' to resume each rank from its own"
            )
        diff = fingerprint_mismatch(identity[1], progress.fingerprint)
        if diff:
            hint = ""
            if any(d.startswith("protocol.sharding:") for d in diff):
                hint = (
                    " (sharding: the state was saved under another sharding; pass the "
                    "saved run's sharding= to resume it)"
                )
            raise ResumeStateError(
                "loader state is from another dataset or config: " + "; ".join(diff) + hint
            )
        length = None if self._iterable else len(self.dataset)
        target = resume_target(
            progress,
            config,
            rank=self.rank,
            length=length,
            id_fn=self.id_fn is not None,
            partition=self.partition,
            sampler=self.sampler,
            shuffle=self.shuffle,
            seed=self.seed,
        )
        remaining = progress.check_for(target)
        if target.order is not None and length is not None:
            key = (progress.epoch, length, self.shuffle, self.seed)
            checked = (progress, self.world_size, self.rank)
            self._loaded_order = (key, target.order, checked, remaining)
        return progress, identity

    def _checked_table(
        self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> CostTable | None:
        """The cost table a state (or every rank's, which must agree) carries, checked
        (`CostTable.from_state`: shape, size = the dataset's length, checksum); None
        when absent."""
        states = [state] if isinstance(state, Mapping) else list(state)
        size = None if self._iterable else len(self.dataset)
        tables = [
            None
            if not isinstance(s, Mapping) or _TABLE_KEY not in s
            else CostTable.from_state(s[_TABLE_KEY], size)
            for s in states
        ]
        if any(t != tables[0] for t in tables[1:]):
            raise ResumeStateError(
                "loader state field cost_table differs between the ranks' states: every "
                "rank prices the deals by the same table"
            )
        return tables[0] if tables else None

    def _identity_for(self, progress: EpochProgress) -> _Identity:
        """The config, fingerprint, digest and sharding choice this loader resumes
        `progress` under. When the default chose the sharding, a state saved under
        the other one resumes under its own where it can: a static state (whose
        fingerprint has no `protocol.sharding`: every state of a run before dynamic
        became the default) under static, since its done ids are per-rank shards
        that only static resumes; a dynamic state under dynamic where only the one
        rank made the default static. A `sharding=` given, or a default that chose
        static for a reason dynamic cannot serve, is kept: a mismatch is then a
        fingerprint error naming `protocol.sharding`."""
        here = self._sharding
        saved = progress.fingerprint.get("protocol.sharding", Sharding.STATIC.value)
        if here.given or saved == here.sharding.value:
            return (self.config, self._fingerprint, self._digest, here)
        if saved == Sharding.STATIC.value:
            adopt = Sharding.STATIC
        elif saved == Sharding.DYNAMIC.value and here.only_one_rank:
            adopt = Sharding.DYNAMIC
        else:
            return (self.config, self._fingerprint, self._digest, here)
        config = self._config_for(adopt)
        fp, digest = self._identity_of(config)
        why = f"default; {adopt.value}: resumed from a state saved under {adopt.value}"
        return (config, fp, digest, ShardingChoice(adopt, why, False))

    def _set_identity(self, identity: _Identity) -> None:
        self.config, self._fingerprint, self._digest, self._sharding = identity
        self._length.config = self.config

    def _snapshot(self) -> tuple[Any, ...]:
        identity = (self.config, self._fingerprint, self._digest, self._sharding)
        return (self._resume, self._carry, self.epoch, self._advance, identity)

    def _verify_resume(self) -> None:
        """The first iteration after a load: one collective in which every rank checks
        that every rank loaded the same progress (resume.check_claims); on a mismatch
        every rank raises and the load is undone."""
        snapshot, self._unverified = self._unverified, None
        assert snapshot is not None
        claim = ResumeClaim.of(self._resume, refused=self._refused)
        try:
            rows = self.transport.exchange(
                (self._digest, _RESUME_TAG, self._iteration),
                claim.to_vector(),
                "the resume check of the first iteration",
            )
            check_claims(rows, self.rank)
        except BaseException:
            self._resume, self._carry, self.epoch, self._advance, identity = snapshot
            self._set_identity(identity)
            raise
        finally:
            self._refused = False

    def _reset_progress(self, progress: EpochProgress | None = None) -> None:
        self._tracker.reset(progress, carry=self._carry)

    @property
    def _carry(self) -> Ledgers:
        return self._tracker.position.carry

    @_carry.setter
    def _carry(self, carry: Ledgers) -> None:
        self._tracker.set_carry(carry)

    def _exact(self, progress: EpochProgress) -> bool:
        """Resume exactly (replay) rather than only exactly-once: deterministic mode
        and this rank's own state (so the same world size)."""
        return self.config.deterministic and not progress.is_global

    def _record(self, item: Emitted, serial: int) -> None:
        info = item.info
        self._tracker.record(info, last_of_epoch=item.last_of_epoch)
        self.step_info = info
        if item.last_of_epoch:
            if item.cost_table is not None:
                self._learned = item.cost_table
            self._length.record(self.epoch, info.step + 1)
            self._advance = self._advance or serial == self._serial
            self._close_with(item.ledger)

    def _end(self, end: _End, serial: int) -> None:
        if self._tracker.close():
            self._length.record(self.epoch, self._tracker.position.step)  # it ran no step
        self._advance = self._advance or serial == self._serial
        if end.cost_table is not None:
            self._learned = end.cost_table
        self._close_with(end.ledger)
        self.epoch_stats = end.stats

    def _close_with(self, ledgers: Ledgers) -> None:
        if self.ledgers is ledgers and self._carry is ledgers:
            return  # the last step already applied this close
        self._carry = self.ledgers = ledgers
        self.ledger = ledger_ids(ledgers)
        self.ledger_ages = ages(ledgers, self.ledger_ages)
        if self.config.mode is Mode.QUOTA:
            log.info(
                "odb: rank %d: quota epoch %d closed at step %d; %d samples carried into "
                "the next epoch (%d from this rank)",
                self.rank,
                self.epoch,
                self._tracker.position.step,
                len(self.ledger),
                len(ledgers[self.rank]) if self.rank < len(ledgers) else 0,
            )

    def _excluded(self, progress: EpochProgress | None) -> frozenset[int]:
        if progress is None:
            return frozenset()
        return progress.excluded(self.world_size, self.rank)

    def _start_source(
        self, progress: EpochProgress | None, excluded: frozenset[int], start_step: int
    ) -> tuple[list[int] | None, int]:
        """Point the inner loader at this rank's indices. Returns them (map-style) and
        a digest of the epoch, the step the protocol run starts at and the epoch
        order, which every round's all-gather compares across ranks: a sampler that
        is not seeded alike on every rank, ranks in different epochs (one advanced
        by itself, another told to repeat) or resuming differently fail loudly."""
        head = [self.epoch, start_step]
        remaining: list[int] | None = None
        if self._index_sampler is None:
            return None, zlib.crc32(array.array("q", head).tobytes())
        if self.sampler is not None:
            set_epoch = getattr(self.sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
            order = sampler_order(self.sampler)
        else:
            # Reuse the order load_state_dict just computed (a 1M-sample shuffle is
            # tens of ms); it is used once, so no order outlives its iteration.
            key = (self.epoch, len(self.dataset), self.shuffle, self.seed)
            hint, self._loaded_order = self._loaded_order, None
            if hint is not None and hint[0] == key:
                order = list(hint[1])  # a copy: the shard below may be this list
                checked, mine = hint[2], hint[3]
                if checked[0] is progress and checked[1:] == (self.world_size, self.rank):
                    remaining = mine
            else:
                order = epoch_order(
                    len(self.dataset), shuffle=self.shuffle, seed=self.seed, epoch=self.epoch
                )
        if self.config.dynamic:
            return self._deal_source(progress, order, excluded, head)
        if not self.partition:
            # With id_fn the done ids are not indices: the producer skips them.
            shard = order if self.id_fn is not None else [i for i in order if i not in excluded]
        elif self.id_fn is not None or progress is None:
            # With id_fn the done ids are not indices: split the whole order and let
            # the producer skip done ids; the split is the same in every incarnation.
            shard = partition(order, self.world_size, self.rank)
        else:
            shard = (
                remaining
                if remaining is not None
                else progress.shard(order, self.world_size, self.rank)
            )
        carry = self._carry
        if carry:
            # A resumed incarnation re-deals what is left of the carry, as it re-splits
            # what is left of the order (odb_core.resume): the same plan on every rank.
            if progress is not None and self.partition:
                carry = without(carry, progress.base_done)
            shard = rank_order(
                carry, shard, self.world_size, self.rank, keep_on_rank=not self.partition
            )
            shard = [i for i in shard if i not in excluded]
        self._index_sampler.indices = shard
        flat = head
        if self.partition:
            flat = [*head, *order, -1, *ledger_ids(carry)]
        return shard, zlib.crc32(array.array("q", flat).tobytes())

    def _deal_source(
        self,
        progress: EpochProgress | None,
        order: list[int],
        excluded: frozenset[int],
        head: list[int],
    ) -> tuple[list[int], int]:
        """Dynamic sharding: the epoch's plan is what is left of the order (the same
        on every rank); this rank's source starts on its initial share and the core
        deals it the rest (`_restart_source`)."""
        assert progress is None or progress.is_global or progress.world_size == 1
        # Quota mode: the last pass's ledger comes first, dealt (and formed) first.
        carried = ledger_ids(self._carry)
        taken = set(carried)
        fresh = (i for i in order if i not in taken)
        self._plan = tuple(i for i in (*carried, *fresh) if i not in excluded)
        start, stop = initial_slice(self.rank, len(self._plan), self.world_size, self.config.target)
        shard = list(self._plan[start:stop])
        assert self._index_sampler is not None
        self._index_sampler.indices = shard
        # The table's checksum too: ranks that would price the deals differently (one
        # loaded a state without the table) fail the first round's tag check.
        priced = self._pricing_table()
        table = 0 if priced is None else 1 + zlib.crc32(priced.codes)
        flat = [*head, *order, -1, *sorted(excluded), -1, *carried, -1, table]
        return shard, zlib.crc32(array.array("q", flat).tobytes())

    def _pricing_table(self) -> CostTable | None:
        """The table this epoch's deals are priced by: None with `trace_dir` (a traced
        epoch deals as the spec's mean-priced `Deal`, so its trace replays in the
        Python model and TLC) or when it does not cover the dataset."""
        t = self._cost_table
        if t is None or self.trace_dir is not None or len(t) != len(self.dataset):
            return None
        return t

    def _source_iterator(self, config: ProtocolConfig) -> Iterator[Any]:
        """The inner loader's iterator; with early forms, read ahead on its own thread
        (torch/lookahead.py) so the protocol loop can see whether a sample is there."""
        inner = iter(self._inner)
        return inner if config.early_form is None else LookAhead(inner)

    def close(self) -> None:
        """Stop the current iteration's protocol thread and its DataLoader workers,
        after the rounds every rank issues anyway. Call it on every rank when
        training ends, before `destroy_process_group`, so that no thread of the
        loader is inside a collective while the group is torn down (trainer
        adapters do it at train end). Iterating again starts as usual. An iterator
        dropped mid-epoch (a loop that broke out and let it go) stops alike, at
        once, without waiting for the thread and workers to end; close() waits."""
        with self._lock:
            self._stop_pipeline()

    def _stop_pipeline(self) -> None:
        p = self._pipeline
        if p is None:
            return
        self._pipeline = None
        p.close(timeout=self.transport_timeout + 60.0)
        if p.alive:
            raise ODBError(
                "the previous iteration's protocol thread did not stop (its source or a "
                "peer is stuck)"
            )

    @property
    def transport_timeout(self) -> float:
        return float(getattr(self.transport, "timeout", 0.0))

    def _check_world(self) -> None:
        if (
            isinstance(self.transport, LocalTransport)
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            raise ConfigError(
                "this ODBDataLoader was built before torch.distributed was initialized, so it "
                "cannot keep ranks aligned; construct it after init_process_group"
            )

    @staticmethod
    def _make_transport(peer_timeout: float) -> Transport:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return GlooTransport(float(peer_timeout))
        return LocalTransport()

    @staticmethod
    def _make_pin(pin_memory: bool, device: str) -> Callable[[Any], Any] | None:
        if not pin_memory:
            return None
        if not torch.cuda.is_available():
            warnings.warn(
                "pin_memory=True but no accelerator is available: batches are not pinned",
                stacklevel=3,
            )
            return None
        return _pin


class _EpochIterator:
    def __init__(self, loader: ODBDataLoader, pipeline: EpochPipeline, serial: int) -> None:
        self._loader = loader
        self._pipeline = pipeline
        self._serial = serial
        self._finished = False

    def __iter__(self) -> _EpochIterator:
        return self

    def __del__(self) -> None:
        # Dropped mid-epoch (a loop that broke out, a resume that builds a new
        # loader): no step can be taken from this pipeline any more, so stop it now
        # (as close() would) rather than leave its thread and workers waiting.
        if not self._finished:
            self._finished = True
            try:  # noqa: SIM105  (no module global: this may run at interpreter exit)
                self._pipeline.abandon()
            except Exception:
                pass

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if self._loader._pipeline is not self._pipeline:
            self._finished = True
            raise ODBError(
                "this iterator was superseded by a later iter(loader), which ended its epoch"
            )
        try:
            item = self._pipeline.get()
        except BaseException:
            self._finished = True
            raise
        if isinstance(item, _End):
            self._finished = True
            self._loader._end(item, self._serial)
            raise StopIteration
        self._loader._record(item, self._serial)
        return (item.batch, item.info) if self._loader.with_step_info else item.batch


def _pin(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory()
    if isinstance(obj, Mapping):
        pinned = {k: _pin(v) for k, v in obj.items()}
        try:
            return type(obj)(pinned)  # type: ignore[call-arg]
        except TypeError:
            return pinned
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_pin(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pin(v) for v in obj)
    pin = getattr(obj, "pin_memory", None)
    return pin() if callable(pin) else obj


_TABLE_KEY = "cost_table"


def _without_table(
    state: Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> Mapping[str, Any] | Sequence[Mapping[str, Any]]:
    """The state(s) without the cost table, which `EpochProgress` does not hold."""

    def strip(s: Mapping[str, Any]) -> Mapping[str, Any]:
        if isinstance(s, Mapping) and _TABLE_KEY in s:
            return {k: v for k, v in s.items() if k != _TABLE_KEY}
        return s

    if isinstance(state, Mapping):
        return strip(state)
    if isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
        return [strip(s) for s in state]
    return state


def _restart_source(sampler: IndexChunks, inner: DataLoader[Any], ids: list[int]) -> Iterator[Any]:
    """Dynamic sharding: point the inner loader at ids the core newly dealt."""
    sampler.indices = ids
    return iter(inner)


def _pad_fallback(dataset: Any, rank: int) -> Any:
    """A rank whose shard is empty still needs a shape-valid batch for its pad steps.
    (A module function, not a method: no loader <-> pipeline reference cycle.)"""
    if isinstance(dataset, IterableDataset) or len(dataset) == 0:
        raise ODBError(
            f"rank {rank} has no sample this epoch to build its pad batches from "
            "(fewer samples than ranks in the stream); give every rank at least one sample"
        )
    try:
        return dataset[0]
    except Exception as exc:
        raise SampleLoadError(LoadFailure(0, type(exc).__name__, str(exc), "")) from exc
