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

This module is the loader's face: construction, iteration, the facts it reports
and its lifecycle. Its parts: the options (torch/options.py), this rank's source
and its per-epoch indices (rank_source.py), the epoch selection
(epoch_select.py), the iterator of a pass (epoch_iter.py), the checks of a
loaded state (loader_resume.py), the length (length.py), the epoch's runner
(pipeline.py) and its round loop (rounds.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from odb_core.config import (
    LossNormalization,
    Mode,
    OversizePolicy,
    Sharding,
)
from odb_core.cost import CostKind, CostModel
from odb_core.cost_table import CostTable
from odb_core.epoch import EpochTracker
from odb_core.errors import ConfigError, ODBError
from odb_core.formers import FormerKind
from odb_core.ledger import Ledgers, ages, ledger_ids
from odb_core.protocol import RankMachine
from odb_core.resume import EpochProgress, ResumeReport
from odb_core.step import StepInfo
from odb_core.torch.epoch_iter import EpochIterator, make_pin
from odb_core.torch.epoch_select import EpochCursor, forward_epoch
from odb_core.torch.length import EpochLength
from odb_core.torch.loader_facts import LoaderFacts
from odb_core.torch.loader_resume import (
    Identity,
    State,
    StateChecks,
    verify_claims,
    with_table,
    without_table,
)
from odb_core.torch.measure import CostFn, LossTokens, LossTokensFn, TruncateFn
from odb_core.torch.meta import scaled_loss
from odb_core.torch.options import LoaderOptions
from odb_core.torch.pipeline import EpochPipeline
from odb_core.torch.rank_source import LoadedOrder, RankSource, pricing_table
from odb_core.torch.rounds import Emitted, EpochSetup, EpochStats, _End
from odb_core.torch.source import WorkerGuard
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


class ODBDataLoader(LoaderFacts):
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

    Each keyword argument is one field of a group of `loader.options`, documented
    there (odb_core.torch.options); DataLoader's `batch_size`, `batch_sampler` and
    `drop_last` are refused: the token budget replaces them.

    Args:
        Batches (`options.batch`): `token_budget` (per batch, under `cost_model`:
            'packed' by default, 'padded', 'attention', 'multimodal' or a
            `CostModel`), `cost_fn(sample) -> tokens | (tokens, visual_tokens[,
            patches])` (default `len(sample["input_ids"])`), `oversize` ('error' |
            'solo' | 'truncate'), `max_samples`, `max_patches`, `window_bytes` (a
            bound on the tensor bytes a rank holds; 1 GiB by default in join mode
            under static sharding; 0: none). Advanced: `buffer_size` (the window,
            in samples), `former`, `max_steps_per_round`, `early_form` /
            `early_form_wait` (form a partial window early when samples are slow).
        Epochs (`options.epoch`): `shuffle`, `seed` (per-epoch shuffle, the same on
            every rank), `sampler`, `mode` ('join' | 'quota'), `quota`,
            `deterministic` (exact same-world-size resume), `partition` (False: the
            dataset already yields this rank's shard), `id_fn`, `sharding`
            ('static' | 'dynamic'; unset: `describe()` says which and why).
        Loss (`options.loss`): `loss_normalization` ('tokens' | 'samples'),
            `grad_accum_steps` / `tokens_per_update` (optimizer windows),
            `loss_tokens_fn`, `label_shift`, `ignore_index`, `truncate_fn`.
        Output (`options.output`): `collate_fn`, `step_meta` (False: yield exactly
            collate_fn's output), `with_step_info` (yield `(batch, step_info)`),
            `trace_dir` (record every epoch's protocol trace).
        Workers (`options.workers`): DataLoader's `num_workers`, `pin_memory`,
            `timeout`, `worker_init_fn`, `multiprocessing_context`, `generator`,
            `prefetch_factor`, `persistent_workers`, `pin_memory_device`.
            Advanced: `samples_per_fetch` (samples per worker round trip),
            `prefetch_thread` (False: form batches in the iterating thread).
        `peer_timeout` (`options.peer_timeout`): seconds before a dead or hung peer
            raises ODBPeerError.

    Step counts: `len(loader)` is for progress bars (an upper estimate made before
    any epoch ran: never cut an epoch at it); `loader.epoch_steps` holds the
    realised count of each finished epoch. Trainer adapters size schedules and caps
    from `planned_steps()`, `steps_estimate()`, `step_bound()` and
    `optimizer_steps(steps)`.
    """

    _odb_seq = 0  # which loader of this process (set by _announce_failure)

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
        # is applied (torch/options.py); from here on the loader reads them there.
        self.options = LoaderOptions.of(
            **{k: v for k, v in locals().items() if k not in ("self", "dataset")}
        )
        o = self.options
        iterable = o.check_dataset(dataset)
        self.dataset = dataset
        self.transport: Transport = self._make_transport(o.peer_timeout)
        self.rank = self.transport.rank
        self.world_size = self.transport.world_size
        choice = o.sharding(iterable=iterable, world=self.world_size)
        config = o.protocol_config(self.world_size, choice.sharding)
        o.check_placement(dynamic=config.dynamic, iterable=iterable, world=self.world_size)
        loss = o.loss
        self.loss_tokens = LossTokens(loss.loss_tokens_fn, loss.label_shift, loss.ignore_index)
        self._iterable = iterable
        self._pin = make_pin(o.workers.pin_memory, o.workers.pin_memory_device, stacklevel=3)
        self._guard = WorkerGuard(o.workers.worker_init_fn)
        self._source = RankSource(
            dataset,
            o,
            iterable=iterable,
            rank=self.rank,
            world_size=self.world_size,
            guard=self._guard,
        )
        self._checks = StateChecks(
            dataset, o, iterable=iterable, rank=self.rank, world_size=self.world_size
        )
        self._length = EpochLength(config)
        self._set_identity(self._checks.identity(config, choice))
        # Every argument is valid here: only now meet the peers (a ConfigError on any
        # rank reaches all of them) and create the gloo group.
        connect = getattr(self.transport, "connect", None)
        if callable(connect):
            fp = json.loads(json.dumps(self._fingerprint, sort_keys=True, default=str))
            connect(fp, getattr(self, "_odb_seq", None))
        self._guard.inodes = getattr(self.transport, "socket_inodes", frozenset())
        self._init_state()
        if self.rank == 0:
            self._log_choices()

    def _log_choices(self) -> None:
        """One log line: the sharding and the window's byte bound in force, and why."""
        d = self.describe()
        log.info(
            "odb: sharding=%s (%s); window_bytes=%s (%s)",
            d["sharding"],
            d["sharding_reason"],
            d["window_bytes"],
            d["window_bytes_reason"],
        )

    def _init_state(self) -> None:
        """The loader's state before its first iteration."""
        self._lock = threading.Lock()
        self._pipeline: EpochPipeline | None = None
        self._iteration = 0
        self._workers_started = False
        # Which epoch, whether it completed, the loaded state not yet iterated.
        self._cursor = EpochCursor()
        # The loader as it was before a load not yet checked across ranks (and
        # whether the last load was refused): see _verify_resume.
        self._unverified: tuple[Any, ...] | None = None
        self._refused = False
        # The order load_state_dict computed to check the state, kept for the first
        # iteration after it (rank_source.LoadedOrder).
        self._loaded_order: LoadedOrder | None = None
        # Dynamic sharding: the costs observed in the last closed epoch, which price
        # the next deals (odb_core.cost_table); None: priced at the mean.
        self._cost_table: CostTable | None = None
        # What the current epoch's close learned: in force from the next epoch on.
        self._learned: CostTable | None = None
        # What the last load_state_dict resumed from (None before any).
        self.resume_report: ResumeReport | None = None
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
        self._reset_progress()

    # Internals the tests read: this rank's source.
    _plan = property(lambda self: self._source.plan)
    _index_sampler = property(lambda self: self._source.index_sampler)
    _inner = property(lambda self: self._source.inner)

    # ---- DataLoader surface ------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        check_trainer_context(self)
        with self._lock:
            self._stop_pipeline()
            self._check_world()
            if self._unverified is not None:
                self._verify_resume()
            if self._cursor.advance:
                self._next_epoch()
            if self._learned is not None:  # a closed epoch taught it: the next pass's
                self._cost_table, self._learned = self._learned, None
            self._iteration += 1
            setup = self._epoch_setup()
            if setup is None:
                return iter(())
            w = self.options.workers
            self._workers_started = w.num_workers > 0
            self._pipeline = EpochPipeline(setup, threaded=bool(w.prefetch_thread))
            self._pipeline.start()
            pairs = self.options.output.with_step_info
            return EpochIterator(self, self._pipeline, self._cursor.serial, pairs=pairs)

    def _epoch_setup(self) -> EpochSetup | None:
        """The protocol run of this pass: where it starts, its config, its source; None
        when the loaded state's quota is already spent (the pass is closed)."""
        progress = self._cursor.pending()
        self._cursor.resume = None
        self._reset_progress(progress)
        self.step_info = None
        # Where this protocol run starts: the epoch's start, the saved step (a
        # resume that keeps exactly-once), or, for an exact resume, the start of
        # the run the state was saved from, which it replays.
        run = self._tracker.plan(progress, exact=progress is not None and self._exact(progress))
        step0, emitted0, window0 = run.start
        config = self.config
        if progress is not None and config.quota is not None:
            left = config.quota - emitted0
            if left <= 0:
                self._tracker.close()
            else:
                config = replace(config, quota=left)
        if self._tracker.position.closed:
            return None
        excluded = self._excluded(run.plan)
        self.carried_in = ledger_ids(self._carry)
        if self.carried_in:
            # The core forms the carried ids ahead of fresh ones (bounded carry).
            config = replace(config, carried=frozenset(self.carried_in))
        hint, self._loaded_order = self._loaded_order, None
        priced = self._pricing_table()
        shard, order_digest = self._source.start(
            self.epoch,
            run.plan,
            excluded,
            step0,
            config=config,
            carry=self._carry,
            hint=hint,
            priced=priced,
        )
        if config.dynamic:
            config = replace(config, plan=self._source.plan, cost_table=priced)
        out = self.options.output
        trace_path = None
        if out.trace_path is not None:
            trace_path = out.trace_path / (
                f"trace-epoch{self.epoch}-step{step0}-rank{self.rank}.json"
            )
        machine_cls = RankMachine if trace_path is None else TracingRankMachine
        self._guard.owner = os.getpid()
        self._guard.inodes = getattr(self.transport, "socket_inodes", frozenset())
        b, id_fn = self.options.batch, self.options.epoch.id_fn
        return EpochSetup(
            machine=machine_cls(self.rank, config),
            transport=self.transport,
            source=self._source.iterator(config),
            tag=(self._digest, order_digest, self._iteration),
            excluded=excluded,
            step_offset=step0,
            collate=out.collate,
            cost_fn=b.cost_fn,
            loss_tokens=self.loss_tokens,
            id_fn=id_fn,
            truncate_fn=self.options.loss.truncate_fn,
            pin=self._pin,
            pad_fallback=self._source.pad_fallback(),
            shard=shard if id_fn is None else None,
            trace_path=trace_path,
            window_offset=window0,
            step_meta=out.step_meta,
            skip_before=run.skip_before,
            replay_ids=run.replay_ids,
            restart=self._source.restart(config),
            early_form_wait=float(b.early_form_wait) if config.early_form else None,
            fetch=self.options.workers.samples_per_fetch,
            table_size=len(self.dataset) if config.dynamic else None,
        )

    # ---- epochs ---------------------------------------------------------------

    def set_epoch(self, epoch: int, *, repeat: bool = False) -> None:
        """Select the epoch (its shuffle order); call it on every rank, as with
        DistributedSampler. Forwarded to the dataset and sampler if they have one.

        Without it, iterating again after a completed epoch starts the next one, as
        does iterating after loading a state saved at an epoch's end. Naming an
        epoch that has completed (the one just finished, or an earlier one) raises
        `EpochFinishedError`, unless `repeat=True` says to train it again."""
        self._cursor.select(epoch, repeat=repeat, reset=self._reset_progress)
        forward_epoch(self.dataset, epoch, stale_workers=self._stale_workers, stacklevel=3)

    def _next_epoch(self) -> None:
        """The epoch completed and set_epoch was not called since: start the next."""
        done = self._cursor.next_epoch(self._reset_progress)
        log.info(
            "odb: rank %d: epoch %d completed; iterating again starts epoch %d (call "
            "set_epoch(e) to choose the epoch)",
            self.rank,
            done,
            self.epoch,
        )
        forward_epoch(self.dataset, self.epoch, stale_workers=self._stale_workers, stacklevel=4)

    @property
    def _stale_workers(self) -> bool:
        """Persistent workers run, whose dataset copies a set_epoch does not reach."""
        return self._workers_started and bool(self.options.workers.persistent_workers)

    # ---- the quota carry ------------------------------------------------------

    @property
    def _carry(self) -> Ledgers:
        return self._tracker.position.carry

    @_carry.setter
    def _carry(self, carry: Ledgers) -> None:
        self._tracker.set_carry(carry)

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

    def _record(self, item: Emitted, serial: int) -> None:
        info = item.info
        self._tracker.record(info, last_of_epoch=item.last_of_epoch)
        self.step_info = info
        if item.last_of_epoch:
            if item.cost_table is not None:
                self._learned = item.cost_table
            self._length.record(self.epoch, info.step + 1)
            self._cursor.advance = self._cursor.advance or serial == self._cursor.serial
            self._close_with(item.ledger)

    def _end(self, end: _End, serial: int) -> None:
        if self._tracker.close():
            self._length.record(self.epoch, self._tracker.position.step)  # it ran no step
        self._cursor.advance = self._cursor.advance or serial == self._cursor.serial
        if end.cost_table is not None:
            self._learned = end.cost_table
        self._close_with(end.ledger)
        self.epoch_stats = end.stats

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
        if self._cursor.resume is not None:
            return self._with_table(self._cursor.resume.to_dict())
        return self._with_table(self._tracker.current(**self._place()).to_dict())

    def state_after(self, step: int | None) -> dict[str, Any]:
        """`state_dict()` as of step `step` of the current pass, one of the last few
        yielded (None: before the pass's first), for a trainer that prefetches
        batches: a resume from it continues with step `step + 1`."""
        if self._cursor.resume is not None:  # loaded, not iterated yet
            return self._with_table(self._cursor.resume.to_dict())
        return self._with_table(self._tracker.after(step, **self._place()).to_dict())

    @property
    def cost_table(self) -> CostTable | None:
        """The learned cost table the next deals are priced by (dynamic sharding:
        what the ranks observed in the last closed epoch, or what a loaded state
        carried); None: priced at the gathered mean."""
        return self._learned if self._learned is not None else self._cost_table

    def _with_table(self, state: dict[str, Any]) -> dict[str, Any]:
        return with_table(state, self._cost_table, self._learned)

    def _place(self) -> dict[str, Any]:
        return {
            "fingerprint": self._fingerprint,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load_state_dict(self, state: State) -> None:
        """Resume from `state_dict()` (this rank's) or a list of every rank's states.

        The state is checked before anything is applied (schema, version, checksum,
        this dataset and config, internal consistency: `ResumeStateError`), and, in
        one collective at the first iteration after the load, against what every
        other rank loaded (`ResumeMismatchError` on every rank, the load undone)."""
        here = Identity(self.config, self._fingerprint, self._digest, self._sharding)
        try:
            table = self._checks.table(state)
            progress, identity, order = self._checks.progress(without_table(state), here)
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
            self._loaded_order = order
            self._cursor.serial += 1
            self._set_identity(identity)
            self._cost_table, self._learned = table, None
            self._cursor.resume = progress
            self._carry = progress.carry
            self._cursor.epoch = progress.epoch
            # A state taken after the epoch's last batch: the epoch completed, so
            # iterating starts the next one, as it would have in the saved run.
            self._cursor.advance = progress.closed
            self.resume_report = ResumeReport.of(progress, self.world_size)

    def _set_identity(self, identity: Identity) -> None:
        self.config, self._fingerprint, self._digest, self._sharding = identity
        self._length.config = self.config

    def _snapshot(self) -> tuple[Any, ...]:
        identity = Identity(self.config, self._fingerprint, self._digest, self._sharding)
        c = self._cursor
        return (c.resume, self._carry, c.epoch, c.advance, identity)

    def _verify_resume(self) -> None:
        """The first iteration after a load: one collective in which every rank checks
        that every rank loaded the same progress (resume.check_claims); on a mismatch
        every rank raises and the load is undone."""
        snapshot, self._unverified = self._unverified, None
        assert snapshot is not None
        c = self._cursor
        try:
            verify_claims(
                self.transport,
                self._digest,
                self._iteration,
                c.resume,
                refused=self._refused,
                rank=self.rank,
            )
        except BaseException:
            c.resume, self._carry, c.epoch, c.advance, identity = snapshot
            self._set_identity(identity)
            raise
        finally:
            self._refused = False

    def _reset_progress(self, progress: EpochProgress | None = None) -> None:
        self._tracker.reset(progress, carry=self._carry)

    def _exact(self, progress: EpochProgress) -> bool:
        """Resume exactly (replay) rather than only exactly-once: deterministic mode
        and this rank's own state (so the same world size)."""
        return self.config.deterministic and not progress.is_global

    def _excluded(self, progress: EpochProgress | None) -> frozenset[int]:
        if progress is None:
            return frozenset()
        return progress.excluded(self.world_size, self.rank)

    def _pricing_table(self) -> CostTable | None:
        """The table this epoch's deals are priced by (rank_source.pricing_table)."""
        traced = self.options.output.trace_dir is not None
        size = 0 if self._iterable else len(self.dataset)
        return pricing_table(self._cost_table, traced=traced, size=size)

    # ---- lifecycle -------------------------------------------------------------

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
