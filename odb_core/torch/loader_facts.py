"""The facts an `ODBDataLoader` reports, for its user and the trainer adapters: what
is in force (`describe`, the options as read-only attributes), its step counts
(`len(loader)` for progress bars, `epoch_steps` realised; the estimates and bounds
adapters size schedules and caps by) and the run's progress. `LoaderFacts` is the
loader's base class: it only reads the state the loader keeps (declared below)."""

from __future__ import annotations

import math
from typing import Any

from odb_core.config import Mode, ProtocolConfig
from odb_core.epoch import EpochTracker
from odb_core.estimate import StepsEstimate
from odb_core.ledger import Ledgers
from odb_core.progress import RunProgress
from odb_core.sample import Sample
from odb_core.schedule import SampleProfile
from odb_core.torch.epoch_select import EpochCursor
from odb_core.torch.length import EpochLength, shard_sizes
from odb_core.torch.measure import LossTokens, measure
from odb_core.torch.options import LoaderOptions, ShardingChoice
from odb_core.torch.source import read_sample

__all__ = ["LoaderFacts"]


def _option(group: str, name: str, doc: str) -> Any:
    """A read-only attribute of the loader that is the option `name` of `group`."""
    return property(lambda self: getattr(getattr(self.options, group), name), doc=doc)


class LoaderFacts:
    """What an `ODBDataLoader` reports (see the module docstring)."""

    options: LoaderOptions
    dataset: Any
    world_size: int
    config: ProtocolConfig
    loss_tokens: LossTokens
    ledger: tuple[int, ...]
    ledgers: Ledgers
    _sharding: ShardingChoice
    _iterable: bool
    _length: EpochLength
    _tracker: EpochTracker
    _cursor: EpochCursor

    @property
    def epoch(self) -> int:
        """The current epoch (`set_epoch`; iterating after a completed one starts the next)."""
        return self._cursor.epoch

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

    # ---- the options, as the loader's attributes (read-only) -------------------

    collate_fn = property(
        lambda self: self.options.output.collate, doc="`collate_fn`, or default_collate."
    )
    cost_fn = _option("batch", "cost_fn", "The `cost_fn` option.")
    id_fn = _option("epoch", "id_fn", "The `id_fn` option.")
    truncate_fn = _option("loss", "truncate_fn", "The `truncate_fn` option.")
    step_meta = _option("output", "step_meta", "The `step_meta` option.")
    with_step_info = _option("output", "with_step_info", "The `with_step_info` option.")
    seed = _option("epoch", "seed", "The `seed` option.")
    shuffle = _option("epoch", "shuffle", "The `shuffle` option.")
    sampler = _option("epoch", "sampler", "The `sampler` option.")
    partition = _option("epoch", "partition", "The `partition` option.")
    num_workers = _option("workers", "num_workers", "The `num_workers` option.")
    persistent_workers = _option(
        "workers", "persistent_workers", "The `persistent_workers` option."
    )
    prefetch_thread = _option("workers", "prefetch_thread", "The `prefetch_thread` option.")
    early_form_wait = _option("batch", "early_form_wait", "The `early_form_wait` option.")
    trace_dir = property(
        lambda self: self.options.output.trace_path, doc="`trace_dir` as a Path, or None."
    )

    def __len__(self) -> int:
        """An upper estimate of an epoch's steps, for progress bars: the estimate made
        before any epoch ran (`planned_steps().upper`), so it does not change between
        epochs for the same data, seed policy and world size. The real count is
        decided online and may exceed it: never cut an epoch at len(), and drive an
        LR schedule by `run_progress` (`odb_core.torch.ProgressLR`)."""
        return self.planned_steps().upper

    # ---- step counts and progress ---------------------------------------------

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
        pending = self._cursor.pending()
        if pending is not None:
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
        e = self.options.epoch
        if self._iterable or not e.partition:
            return 0
        source = e.sampler if e.sampler is not None else self.dataset
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
        cost_fn = self.options.batch.cost_fn

        def measure_one(i: int) -> Any:
            return measure(read_sample(self.dataset, i), i, cost_fn, self.loss_tokens)

        return self._length.estimate(size, shard_sizes(size, self.world_size), measure_one)

    @property
    def measured_samples(self) -> list[Sample]:
        """The measured samples the step estimate drew (`steps_estimate`; empty
        before it ran): what estimates of part of an epoch are formed from."""
        return self._length.costs

    @property
    def epoch_steps(self) -> dict[int, int]:
        """Realised aligned steps of each finished epoch (the same on every rank): the
        realised count, where `len(loader)` is an estimate."""
        return dict(self._length.realised)

    def step_bound(self) -> int | None:
        """A number of steps no epoch reaches (one step per sample of the dataset),
        for a trainer loop that needs a per-epoch cap; None for an IterableDataset."""
        e = self.options.epoch
        source = e.sampler if e.sampler is not None else self.dataset
        if self._iterable or not hasattr(source, "__len__"):
            return None
        n = len(source)
        return n + 1 if e.partition else n * self.world_size + 1

    def optimizer_steps(self, steps: int) -> int:
        """The optimizer steps (windows) of an epoch of `steps` steps: ceil(steps / G)
        with grad_accum_steps=G, `steps` with tokens_per_update (a window is at least
        one step); e.g. `optimizer_steps(len(loader))` sizes a schedule."""
        if self.config.tokens_per_update is not None:
            return int(steps)
        return math.ceil(int(steps) / (self.config.grad_accum_steps or 1))

    @property
    def epoch_closed(self) -> bool:
        """Whether the current epoch has closed: the batch just yielded was its last
        (known as it is yielded, no lookahead), or the loaded state was saved at its end."""
        if self._cursor.resume is not None:
            return self._cursor.resume.closed
        return self._tracker.position.closed

    @property
    def carried_count(self) -> int:
        """How many samples the last closed epoch carried into the next (all ranks)."""
        return len(self.ledger)
