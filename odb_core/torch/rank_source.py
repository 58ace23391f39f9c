"""This rank's source of samples for `ODBDataLoader`: the inner torch DataLoader
over the user's dataset (public API, `batch_size=None`, any start method,
persistent workers or not), built once, and, each epoch, the indices it reads.

Static sharding points it at this rank's shard of the epoch order (what is left of
it after a resume, the quota carry first); dynamic sharding at this rank's initial
share of the epoch's plan, then at what the core deals it (`restart`). Each epoch
has a digest (the epoch, the step its protocol run starts at, the order, the
carry, the pricing table) that every round's all-gather compares across ranks.
"""

from __future__ import annotations

import array
import functools
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from odb_core.config import ProtocolConfig
from odb_core.cost_table import CostTable
from odb_core.errors import ODBError
from odb_core.ledger import Ledgers, ledger_ids, rank_order, without
from odb_core.protocol import initial_slices_of
from odb_core.resume import EpochProgress, partition
from odb_core.torch.lookahead import LookAhead
from odb_core.torch.options import LoaderOptions
from odb_core.torch.sharding import epoch_order, sampler_order
from odb_core.torch.source import (
    IndexChunks,
    IterSource,
    MapSource,
    WorkerGuard,
    identity,
    read_sample,
)

__all__ = ["LoadedOrder", "RankSource", "pricing_table"]

# What load_state_dict computed to check a state, kept for the first iteration after
# it: (epoch, dataset length, shuffle, seed), the epoch order, (progress, world, rank)
# it was checked for, and that rank's remaining ids (or None).
LoadedOrder = tuple[
    tuple[int, int, bool, int], Sequence[int], tuple[EpochProgress, int, int], list[int] | None
]


class RankSource:
    """The inner DataLoader of one loader and the indices it reads each epoch."""

    def __init__(
        self,
        dataset: Any,
        options: LoaderOptions,
        *,
        iterable: bool,
        rank: int,
        world_size: int,
        guard: WorkerGuard,
    ) -> None:
        w = options.workers
        self.dataset = dataset
        self.epoch_options = options.epoch
        self.rank = rank
        self.world_size = world_size
        self.index_sampler: IndexChunks | None = None
        self.plan: tuple[int, ...] = ()  # dynamic sharding: this epoch's plan
        if iterable:
            source: Any = IterSource(
                dataset, rank, world_size, options.epoch.partition, w.samples_per_fetch
            )
        else:
            source = MapSource(dataset)
            self.index_sampler = IndexChunks(w.samples_per_fetch)
        self.inner = DataLoader(
            source,
            batch_size=None,
            sampler=self.index_sampler,
            num_workers=w.num_workers,
            collate_fn=identity,
            pin_memory=False,
            timeout=w.timeout,
            worker_init_fn=guard,
            multiprocessing_context=w.multiprocessing_context,
            generator=w.generator,
            prefetch_factor=w.prefetch_factor,
            persistent_workers=w.persistent_workers,
        )

    def start(
        self,
        epoch: int,
        progress: EpochProgress | None,
        excluded: frozenset[int],
        start_step: int,
        *,
        config: ProtocolConfig,
        carry: Ledgers,
        hint: LoadedOrder | None,
        priced: CostTable | None,
    ) -> tuple[list[int] | None, int]:
        """Point the inner loader at this rank's indices. Returns them (map-style) and
        a digest of the epoch, the step the protocol run starts at and the epoch
        order, which every round's all-gather compares across ranks: a sampler that
        is not seeded alike on every rank, ranks in different epochs (one advanced
        by itself, another told to repeat) or resuming differently fail loudly.
        `hint`: the order a load just computed (a 1M-sample shuffle is tens of ms),
        used when it is this epoch's; `priced`: the table the deals are priced by."""
        head = [epoch, start_step]
        if self.index_sampler is None:
            return None, zlib.crc32(array.array("q", head).tobytes())
        order, remaining = self._order(epoch, progress, hint)
        if config.dynamic:
            return self._deal(progress, order, excluded, head, config, carry, priced)
        e = self.epoch_options
        if not e.partition:
            # With id_fn the done ids are not indices: the producer skips them.
            shard = order if e.id_fn is not None else [i for i in order if i not in excluded]
        elif e.id_fn is not None or progress is None:
            # With id_fn the done ids are not indices: split the whole order and let
            # the producer skip done ids; the split is the same in every incarnation.
            shard = partition(order, self.world_size, self.rank)
        else:
            shard = (
                remaining
                if remaining is not None
                else progress.shard(order, self.world_size, self.rank)
            )
        if carry:
            # A resumed incarnation re-deals what is left of the carry, as it re-splits
            # what is left of the order (odb_core.resume): the same plan on every rank.
            if progress is not None and e.partition:
                carry = without(carry, progress.base_done)
            shard = rank_order(
                carry, shard, self.world_size, self.rank, keep_on_rank=not e.partition
            )
            shard = [i for i in shard if i not in excluded]
        self.index_sampler.indices = shard
        flat = head
        if e.partition:
            flat = [*head, *order, -1, *ledger_ids(carry)]
        return shard, zlib.crc32(array.array("q", flat).tobytes())

    def _order(
        self, epoch: int, progress: EpochProgress | None, hint: LoadedOrder | None
    ) -> tuple[list[int], list[int] | None]:
        """The epoch's order, and this rank's remaining ids when a load computed them
        for `progress`."""
        e = self.epoch_options
        if e.sampler is not None:
            set_epoch = getattr(e.sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
            return sampler_order(e.sampler), None
        # Reuse the order load_state_dict just computed; it is used once, so no
        # order outlives its iteration.
        key = (epoch, len(self.dataset), e.shuffle, e.seed)
        if hint is not None and hint[0] == key:
            order = list(hint[1])  # a copy: the shard may be this list
            checked, mine = hint[2], hint[3]
            if checked[0] is progress and checked[1:] == (self.world_size, self.rank):
                return order, mine
            return order, None
        return epoch_order(len(self.dataset), shuffle=e.shuffle, seed=e.seed, epoch=epoch), None

    def _deal(
        self,
        progress: EpochProgress | None,
        order: list[int],
        excluded: frozenset[int],
        head: list[int],
        config: ProtocolConfig,
        carry: Ledgers,
        priced: CostTable | None,
    ) -> tuple[list[int], int]:
        """Dynamic sharding: the epoch's plan is what is left of the order (the same
        on every rank); this rank's source starts on its initial share and the core
        deals it the rest (`restart`)."""
        assert progress is None or progress.is_global or progress.world_size == 1
        # Quota mode: the last pass's ledger comes first, dealt (and formed) first.
        carried = ledger_ids(carry)
        taken = set(carried)
        fresh = (i for i in order if i not in taken)
        self.plan = tuple(i for i in (*carried, *fresh) if i not in excluded)
        # The slice the rank's core starts on: the same function of the same agreed
        # state (its config's plan is this plan, placed by this table).
        planned = replace(config, plan=self.plan, cost_table=priced)
        self.plan = planned.plan
        start, stop = initial_slices_of(planned)[self.rank]
        shard = list(self.plan[start:stop])
        assert self.index_sampler is not None
        self.index_sampler.indices = shard
        # The table's checksum too: ranks that would price the deals differently (one
        # loaded a state without the table) fail the first round's tag check.
        table = 0 if priced is None else 1 + zlib.crc32(priced.codes)
        flat = [*head, *order, -1, *sorted(excluded), -1, *carried, -1, table]
        return shard, zlib.crc32(array.array("q", flat).tobytes())

    def iterator(self, config: ProtocolConfig) -> Iterator[Any]:
        """The inner loader's iterator; with early forms, read ahead on its own thread
        (torch/lookahead.py) so the protocol loop can see whether a sample is there."""
        inner = iter(self.inner)
        return inner if config.early_form is None else LookAhead(inner)

    def restart(self, config: ProtocolConfig) -> Callable[[list[int]], Iterator[Any]] | None:
        """Dynamic sharding: how the pipeline points the inner loader at newly dealt
        ids. Not a bound method: the pipeline must not hold the loader's parts (a
        cycle only the cyclic GC frees, which keeps a dropped iterator's workers)."""
        if not config.dynamic or self.index_sampler is None:
            return None
        return functools.partial(_restart_source, self.index_sampler, self.inner)

    def pad_fallback(self) -> Callable[[], Any]:
        """What a rank whose shard is empty builds its pad batches from."""
        return functools.partial(_pad_fallback, self.dataset, self.rank)


def pricing_table(table: CostTable | None, *, traced: bool, size: int) -> CostTable | None:
    """The table an epoch's deals are priced by: None when traced (a traced epoch
    deals as the spec's mean-priced `Deal`, so its trace replays in the Python model
    and TLC) or when it does not cover the dataset (`size` samples)."""
    if table is None or traced or len(table) != size:
        return None
    return table


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
    return read_sample(dataset, 0)
