"""One epoch's round loop: the protocol loop that drives the rank's machine.

The loop pulls processed samples from the inner DataLoader, feeds them to the
`RankMachine`, moves each round's vector through the transport, feeds each
round's decided steps through a `WindowBuffer` (which releases them, final, when
their optimizer window closes) and collates the released steps for the training
loop. Every batching decision is the machine's; this module only does I/O. Its
runner (torch/pipeline.py) drives it on a thread or inline.

Overlap and determinism. The thread may run at most `ROUNDS_AHEAD` rounds ahead
of what the training loop has taken: it issues round r's all-gather only once
the loop has taken every step *released* by rounds < r - ROUNDS_AHEAD (a round
that releases nothing, because its steps wait for their window to close,
imposes nothing; the steps a round releases are already queued, so the gate
never waits on a step that does not exist). Inline, round r+1's all-gather is
issued before the steps round r released are handed out. Every rank releases
the same steps in the same rounds, so the rounds a rank has issued are a
function of the steps its loop has taken, identical on all ranks; a loop that
stops early at the same step on every rank leaves no half-issued collective
behind. The all-gather of round r+1 is in flight while the loop trains on round
r, and the loop observes more samples into the window while it waits (the
machine allows prefetch in its WAITING phase). While the gate holds it, the
thread reads the next window ahead (up to the window's free room) into its own
queue of records, so the workers keep preprocessing; the machine observes them
in source order at its next fill, so the batches do not change.

Exact replay (deterministic resume). With `skip_before` set, the loop runs the
epoch's protocol from the start of its incarnation, exactly as the interrupted
run did (same rounds, so the collectives line up across ranks), but does not
collate or yield the steps before `skip_before`: their samples are read again,
but only their ids are kept, which must be the ids the state says this rank had
emitted (or the replay raises: the dataset is not deterministic).

Quota-mode close. When the final round lands, the rank's ledger (its window and
ready batches at the close, plus the ids of its source order it never delivered)
is all-gathered in one extra collective, right after that round's all-gather on
every rank, and the per-rank ledgers ride on the epoch's last step (and its
end), so a `state_dict()` taken after the last batch already holds them.

Early forms (opt-in, `early_form=`). The source is then read on its own thread
(`lookahead.LookAhead`), so the loop can see without blocking whether the next
sample is there. While filling, whenever the core enables FORM_EARLY (the window
holds at least `early_form` samples, nothing is ready), the loop takes it if the
training loop has no step queued, no sample is waiting and the rest of the window,
at the measured arrival rate, would take longer than `early_form_wait` seconds;
otherwise it waits for the sample as usual. Which batches form early then depends
on when samples arrive: every guarantee holds (exactly once, aligned steps,
budgets), batch composition is not reproducible run to run.

Ids across ranks. At the close, before that ledger exchange, every rank (join or
quota) all-gathers the ids it held this epoch, emitted, skipped as done before a
resume, and its ledger, and raises DuplicateIdError alike if one is on two ranks
(odb_core.identity; proofs/identity_uniqueness.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from odb_core.collective import Contribution
from odb_core.config import Mode, OversizePolicy
from odb_core.cost_table import CostTable, record
from odb_core.errors import ConfigError, ODBError, ODBPeerError, SampleError
from odb_core.identity import check_unique
from odb_core.ledger import Ledgers, validate_ledgers
from odb_core.protocol import RankMachine, _truncated_tokens
from odb_core.sample import Sample
from odb_core.step import StepInfo
from odb_core.torch.held import HeldBytes, tensor_bytes
from odb_core.torch.lookahead import LookAhead, early_form_decision
from odb_core.torch.measure import CostFn, LossTokens, TruncateFn, default_truncate, measure
from odb_core.torch.meta import StepMeta, attach_context, with_meta
from odb_core.torch.options import DEFAULT_WINDOW_BYTES
from odb_core.torch.source import LoadFailure, Record, SampleLoadError
from odb_core.torch.transport import Gathering, Transport
from odb_core.torch.wire import Packed, unpack
from odb_core.trace import ProtocolTrace, TracingRankMachine
from odb_core.window import WindowBuffer

ROUNDS_AHEAD = 2
_IDS_TAG = -3  # marks the close's id-uniqueness collective


class Emitted(NamedTuple):
    info: StepInfo  # final (its window closed)
    batch: Any
    last_of_epoch: bool
    ledger: Ledgers = ()  # on the last step of the epoch: every rank's ledger
    # On the last step of a dynamic-sharding epoch: the costs every rank observed.
    cost_table: CostTable | None = None


class _Failure(NamedTuple):
    exc: BaseException


class EpochStats(NamedTuple):
    """Where one epoch's time went, for `odb bench` and users who profile.

    `round_wait_s[r]`: how long the protocol thread was blocked in round r's
    all-gather (mostly overlapped with training; on the rank that arrives last it
    is the collective's own latency, on the others it includes waiting for that
    rank). `collective_stall_s`: time the training loop waited for a batch while
    the protocol thread was blocked in an all-gather. `stall_s`: all the time the
    loop waited for a batch.

    `window_bytes_*` / `window_samples_*`: the preprocessed samples the loader held,
    from their arrival from the workers to their batch's collation (read ahead, in
    the window, in formed batches), in tensor bytes and in samples: the peak and the
    mean over the moments a sample arrived; `window_bytes_bound` is the configured
    `window_bytes` (None: unbounded). See torch/held.py.
    """

    rounds: int
    collectives: int
    round_wait_s: tuple[float, ...]
    collective_stall_s: float
    stall_s: float
    window_bytes_peak: int = 0
    window_bytes_mean: float = 0.0
    window_samples_peak: int = 0
    window_samples_mean: float = 0.0
    window_bytes_bound: int | None = None


class _End(NamedTuple):
    ledger: Ledgers  # every rank's ids not emitted (quota mode), in rank order
    stats: EpochStats
    cost_table: CostTable | None = None  # what every rank observed (dynamic sharding)


@dataclasses.dataclass
class EpochSetup:
    """Everything one epoch's producer needs; built by the loader in the main thread."""

    machine: RankMachine
    transport: Transport
    source: Iterator[list[Record] | Packed]
    tag: tuple[int, ...]
    excluded: frozenset[int]
    step_offset: int
    collate: Callable[[list[Any]], Any]
    cost_fn: CostFn | None
    loss_tokens: LossTokens
    id_fn: Callable[[Any], object] | None
    truncate_fn: TruncateFn | None
    pin: Callable[[Any], Any] | None
    pad_fallback: Callable[[], Any]
    shard: list[int] | None  # map-style: this rank's source order, for the quota ledger
    trace_path: Path | None
    window_offset: int = 0  # windows of the epoch before this incarnation
    step_meta: bool = True  # put the step metadata into each batch (meta.py)
    # Exact replay: steps (absolute numbers) below this are run but not yielded, and
    # the ids this rank emitted in them must be `replay_ids`.
    skip_before: int = 0
    replay_ids: frozenset[int] = frozenset()
    # Dynamic sharding: a fresh source over the ids the core has newly dealt this rank.
    restart: Callable[[list[int]], Iterator[list[Record] | Packed]] | None = None
    # Early forms: the seconds the rest of the window may take before the rank forms
    # early (the source is then a LookAhead); None: off.
    early_form_wait: float | None = None
    fetch: int = 8  # samples per worker round trip (named in the shared-memory error)
    # Dynamic sharding: the ids of the learned cost table (the dataset's length), which
    # the ranks exchange at the epoch's close; None: nothing learned.
    table_size: int | None = None


class PadTemplate:
    """The raw sample a pad step collates: the shortest of the rank's samples emitted
    so far this epoch (offered in step order, so a replay builds the same pads)."""

    def __init__(self) -> None:
        self.sample: Any = None
        self.length = -1

    def offer(self, raw: Any, length: int) -> None:
        if self.length < 0 or length < self.length:
            self.sample, self.length = raw, length


class RoundLoop:
    """`_rounds()`, the epoch's protocol loop, with what it reads from the source,
    its gate on the steps the training loop has taken, and the epoch's close. The
    runner (`pipeline.EpochPipeline`) drives it."""

    def __init__(self, setup: EpochSetup, *, threaded: bool) -> None:
        self.s = setup
        if isinstance(setup.machine, TracingRankMachine) and setup.shard is not None:
            # The trace's epoch plan: what this rank must see (validation checks coverage).
            setup.machine.trace.plan = [i for i in setup.shard if i not in setup.excluded]
        self._pad = PadTemplate()
        self._threaded = threaded
        self._queue: queue.Queue[Emitted | _Failure | _End] = queue.Queue()
        self._cv = threading.Condition()
        self._taken = 0  # steps the loop has taken (a replay's skipped steps count)
        self._released: list[int] = []  # steps released by rounds 0..q, cumulative
        self._stopping = False
        self._pending: deque[Record] = deque()
        self._pending_sizes: deque[int] = deque()  # tensor bytes of each pending record
        self._held = HeldBytes(
            setup.machine.config.window_bytes,
            advise_over=DEFAULT_WINDOW_BYTES if setup.machine.config.dynamic else None,
            rank=setup.machine.rank,
        )
        self._source_ended = False  # the source returned its end (read ahead, or by _pull)
        self._read_error: Exception | None = None  # raised by the source while reading ahead
        # Set whenever the protocol thread blocks at the gate with nothing to read ahead.
        self._gate_idle = threading.Event()
        self._requested: set[int] = set(setup.machine.queue)  # dynamic: ids sent to workers
        self._raw: dict[int, Any] = {}
        self._cut: dict[int, int] = {}  # truncated before observing: id -> kept tokens
        self._replayed: set[int] = set()
        self._skipped = 0
        self._replay_checked = setup.skip_before <= setup.step_offset
        self._emitted_ids: set[int] = set()
        self._skipped_ids: list[int] = []  # delivered but done before this run
        self._collective_spans: list[tuple[float, float]] = []
        self._stall_spans: list[tuple[float, float]] = []
        self._collectives = 0
        self._in_flight: Gathering | None = None
        self._delivered = 0  # records taken from the source (for the early-form estimate)
        self._look = setup.source if isinstance(setup.source, LookAhead) else None

    def _gate(self, r: int) -> bool:
        """Round r may start once the loop has taken every step released by the
        rounds before r - ROUNDS_AHEAD (the same count on every rank)."""
        if not self._threaded:
            return True  # the training loop drives
        q = r - ROUNDS_AHEAD - 1
        need = self._released[q] if q >= 0 else 0
        while True:
            with self._cv:
                if self._taken >= need or self._stopping:
                    return self._taken >= need
                if self._read_ahead_room() <= 0:
                    self._gate_idle.set()
                    self._cv.wait()
                    continue
            self._read_ahead()  # outside the lock: it may wait for the workers

    def _read_ahead_room(self) -> int:
        """Records the next fill will take that the pipeline does not hold yet: the
        window's free room, less what is already read ahead (0 once the source ended)."""
        if self._source_ended or self._held.full:
            return 0
        m = self.s.machine
        return m.config.buffer_size - len(m.buffer) - len(self._pending)

    def _read_ahead(self) -> None:
        """While the gate holds the thread (the training loop has steps queued, and the
        machine, with batches ready, observes nothing), take one more chunk from the
        source into `_pending`, so the workers keep preprocessing the next window
        instead of idling until the next fill asks for it. The machine observes the
        same samples in the same order (`_pull` takes `_pending` first): batches do
        not change, only when the samples are there. A source error is raised by
        `_pull` where it would have met it, after the records before it."""
        try:
            chunk = next(self.s.source, None)
        except Exception as exc:
            self._read_error = exc
            self._source_ended = True
            return
        if chunk is None:
            self._source_ended = True
            return
        self._arrive(chunk)

    def _arrive(self, chunk: list[Record] | Packed) -> None:
        """Records from the source: pending, each measured once (torch/held.py)."""
        for rec in unpack(chunk) if isinstance(chunk, Packed) else chunk:
            n = 0 if isinstance(rec, LoadFailure) else tensor_bytes(rec[1])
            self._pending.append(rec)
            self._pending_sizes.append(n)
            self._held.arrive(n)

    def _rounds(self) -> Generator[Emitted, None, _End | _Failure]:
        m, t = self.s.machine, self.s.transport
        steps_per_round = m.config.max_steps_per_round
        dynamic = m.config.dynamic
        windows = WindowBuffer(m.config)
        deferred: list[Emitted] = []
        early = self._early if self._look is not None and m.config.early_form else None
        r = 0
        try:
            while self._gate(r):
                c = m.fill(self._pull, early, self._nbytes)
                gathering = self._in_flight = t.start(
                    (*self.s.tag, r), c.to_vector(steps_per_round, dynamic)
                )
                yield from deferred
                deferred = []
                while m.needs_sample and not self._stopping and not gathering.done():
                    sample = self._pull()
                    if sample is None:
                        m.exhaust()
                    else:
                        m.observe(sample, self._nbytes(sample))
                start = time.perf_counter()
                try:
                    rows = gathering.wait()
                finally:
                    self._in_flight = None
                    self._collective_spans.append((start, time.perf_counter()))
                    self._collectives += 1
                result = m.all_gather(
                    [Contribution.from_vector(v, steps_per_round, dynamic) for v in rows]
                )
                released = windows.push(result)
                steps = self._emit(released, result.done)
                self._released.append(len(released) + (self._released[-1] if r else 0))
                if result.done:
                    unemitted = self._ledger(result.carried)
                    self._check_ids(m.round, unemitted)
                    ledger = self._exchange(unemitted, m.round)
                    table = self._learn()
                    if steps:
                        steps[-1] = steps[-1]._replace(ledger=ledger, cost_table=table)
                    yield from steps
                    return _End(ledger, self._stats(m.round), table)
                if self._threaded:
                    yield from steps
                else:
                    deferred = steps
                r += 1
            return _Failure(ODBError("the loader was closed before the epoch ended"))
        finally:
            # A loop stopped early (at the same step on every rank) leaves in flight a
            # round that every rank issued; let it land so the group stays in step.
            g, self._in_flight = self._in_flight, None
            if g is not None:
                with contextlib.suppress(ODBError):
                    g.wait()

    def _emit(self, infos: list[StepInfo], done: bool) -> list[Emitted]:
        out = []
        n = len(infos)
        config = self.s.machine.config
        skipped = 0
        for j, info in enumerate(infos):
            self._emitted_ids.update(info.sample_ids)
            if self.s.step_offset or self.s.window_offset:
                info = dataclasses.replace(
                    info,
                    step=info.step + self.s.step_offset,
                    window=info.window + self.s.window_offset,
                )
            attach_context(info, config.world_size, config.loss_normalization)
            if isinstance(self.s.machine, TracingRankMachine):
                self.s.machine.received([info])
            if info.step < self.s.skip_before:
                self._skip(info)
                skipped += 1
                continue
            if not self._replay_checked:
                self._check_replay()
            batch = None if self._stopping else self._collate(info)
            out.append(Emitted(info, batch, done and j == n - 1))
        if skipped:
            with self._cv:
                self._taken += skipped
                self._cv.notify_all()
        if done and not self._replay_checked:
            self._check_replay()
        return out

    def _skip(self, info: StepInfo) -> None:
        """A replayed step before the resume point: bookkeeping only, no collate."""
        self._skipped += 1
        if info.batch is None:
            return
        for s in info.batch.samples:
            self._cut.pop(s.id, None)
            self._pad.offer(self._raw.pop(s.id), s.length)
            self._held.release(s.id)
            self._replayed.add(s.id)

    def _check_replay(self) -> None:
        self._replay_checked = True
        want = self.s.skip_before - self.s.step_offset
        if self._skipped != want or self._replayed != self.s.replay_ids:
            missing = sorted(self.s.replay_ids - self._replayed)[:10]
            extra = sorted(self._replayed - self.s.replay_ids)[:10]
            raise ODBError(
                f"rank {self.s.machine.rank}: the exact resume replayed {self._skipped} steps "
                f"up to the saved step {self.s.skip_before} (expected {want}) and emitted other "
                f"samples than the saved state records (missing {missing}, unexpected "
                f"{extra}): deterministic=True needs a dataset that yields the same samples "
                "in every run"
            )

    def _stats(self, rounds: int) -> EpochStats:
        # The consumer appends its last stall only after this item is queued; every
        # earlier one is complete, which is all an epoch summary needs.
        spans = list(self._collective_spans)
        stalls = list(self._stall_spans)
        return EpochStats(
            rounds=rounds,
            collectives=self._collectives,
            round_wait_s=tuple(b - a for a, b in spans),
            collective_stall_s=_overlap(spans, stalls),
            stall_s=sum(b - a for a, b in stalls),
            **self._held.stats(),
        )

    def _early(self) -> bool:
        """The observation behind FORM_EARLY (asked only when the core enables it): the
        training loop has no step queued, no sample is waiting, and the rest of the
        window would take longer than `early_form_wait` seconds at the measured
        arrival rate."""
        look, m, wait = self._look, self.s.machine, self.s.early_form_wait
        if look is None or wait is None:
            return False
        missing = m.config.buffer_size - len(m.buffer)
        if self.s.shard is not None:
            missing = min(missing, len(self.s.shard) - self._delivered)
        queued = self._queue.qsize()
        return early_form_decision(look, len(self._pending), missing, wait, queued)

    def _pull(self) -> Sample | None:
        while True:
            if not self._pending:
                error, self._read_error = self._read_error, None
                if error is not None:
                    raise error
                chunk = None if self._source_ended else next(self.s.source, None)
                if chunk is None:
                    self._source_ended = True
                    dealt = self._newly_dealt()
                    if not dealt:
                        return None
                    assert self.s.restart is not None
                    self.s.source = self.s.restart(dealt)
                    self._source_ended = False
                    continue
                self._arrive(chunk)
                continue
            rec = self._pending.popleft()
            n = self._pending_sizes.popleft()
            self._delivered += 1
            if isinstance(rec, LoadFailure):
                self._held.forget(n)
                raise SampleLoadError(rec)
            sid, raw = rec
            if self.s.id_fn is not None:
                sid = _as_id(self.s.id_fn(raw), sid)
            if sid in self.s.excluded:
                self._held.forget(n)
                self._skipped_ids.append(sid)
                continue
            self._held.name(sid, n)
            sample = measure(raw, sid, self.s.cost_fn, self.s.loss_tokens)
            if self.s.machine.config.oversize is OversizePolicy.TRUNCATE:
                raw, sample = self._truncate(raw, sample)
            self._raw[sid] = raw
            return sample

    def _nbytes(self, sample: Sample) -> int:
        """The size the core counts against `window_bytes`: as measured on arrival."""
        return self._held.sizes.get(sample.id, 0)

    def _newly_dealt(self) -> list[int]:
        """Dynamic sharding: the ids the core dealt this rank since its source was
        last pointed at them (the rank loads only these; no sample moves)."""
        m = self.s.machine
        if not m.config.dynamic:
            return []
        fresh = [i for i in m.queue if i not in self._requested]
        self._requested.update(fresh)
        return fresh

    def _truncate(self, raw: Any, sample: Sample) -> tuple[Any, Sample]:
        """Cut an oversize sample's data before the machine observes it, so that its
        loss tokens are counted on what is kept. The machine makes the same cut (the
        same pure keep-count) and records it in `StepInfo.truncated`; the Sample
        keeps its original token count for that."""
        config = self.s.machine.config
        if config.budget.fits_alone(sample, config.cost_model):
            return raw, sample
        kept = _truncated_tokens(sample, config)
        if kept is None:
            return raw, sample  # cannot fit even with no text: the machine raises
        if self.s.truncate_fn is not None:
            raw = self.s.truncate_fn(raw, kept)
        else:
            raw = default_truncate(raw, kept, sample.tokens, sample.id)
        self._cut[sample.id] = kept
        return raw, sample._replace(loss_tokens=self.s.loss_tokens(raw, sample.id))

    def _collate(self, info: StepInfo) -> Any:
        if info.batch is None:
            raw = self._pad.sample if self._pad.length >= 0 else self.s.pad_fallback()
            batch = self.s.collate([raw])
        else:
            raws = []
            for s in info.batch.samples:
                kept = self._cut.pop(s.id, None)
                if kept is not None and kept != s.tokens:
                    raise ODBError(
                        f"sample {s.id}: truncated to {kept} tokens before observing, but the "
                        f"protocol kept {s.tokens}"
                    )
                raw = self._raw.pop(s.id)
                self._held.release(s.id)
                self._pad.offer(raw, s.length)
                raws.append(raw)
            batch = self.s.collate(raws)
        if self.s.step_meta:
            config = self.s.machine.config
            batch = with_meta(
                batch,
                StepMeta.from_info(info, config.world_size, config.loss_normalization).to_tensor(),
            )
        return batch if self.s.pin is None else self.s.pin(batch)

    def _ledger(self, carried: tuple[Sample, ...]) -> tuple[int, ...]:
        """Ids of this rank's epoch not emitted (quota mode): carried by the close,
        plus, for map-style data, those never pulled; in source order, which is
        the order the next epoch takes them in."""
        self._raw.clear()
        self._cut.clear()
        self._held.clear()
        m = self.s.machine
        if m.config.dynamic:
            # What the close carries, the ids dealt to this rank and never read, and
            # on rank 0 the plan ids no rank was dealt (the same on every rank); in
            # plan order, which the next pass deals them in.
            pos = {i: k for k, i in enumerate(m.config.plan)}
            rest = m.unassigned if m.rank == 0 else ()
            return tuple(sorted([*(s.id for s in carried), *m.queue, *rest], key=pos.__getitem__))
        if self.s.shard is None:
            return tuple(s.id for s in carried)
        done = self._emitted_ids | self.s.excluded
        return tuple(i for i in self.s.shard if i not in done)

    def _check_ids(self, round_: int, unemitted: tuple[int, ...]) -> None:
        """At the close, one collective of the ids every rank holds for the epoch
        (emitted, skipped as done, and its quota ledger); every rank raises
        DuplicateIdError alike if an id is on two ranks (odb_core.identity)."""
        if self.s.machine.config.mode is not Mode.QUOTA:
            unemitted = ()
        mine = sorted([*self._emitted_ids, *self._skipped_ids, *unemitted])
        check_unique(
            self.s.transport.exchange(
                (*self.s.tag, round_, _IDS_TAG), mine, "the cross-rank id check at the close"
            )
        )

    def _exchange(self, mine: tuple[int, ...], round_: int) -> Ledgers:
        m = self.s.machine
        if m.config.mode is not Mode.QUOTA:
            return ()  # join mode closes with nothing carried: no extra collective
        rows = self.s.transport.exchange((*self.s.tag, round_), mine)
        if len(rows) != m.config.world_size or list(rows[m.rank]) != list(mine):
            raise ODBPeerError(
                f"rank {m.rank}: the ledger exchange returned {len(rows)} ledgers for world "
                f"size {m.config.world_size}, or not this rank's own"
            )
        try:
            return validate_ledgers(rows)
        except ConfigError as exc:
            raise ODBPeerError(f"rank {m.rank}: inconsistent ledgers from peers: {exc}") from exc

    def _learn(self) -> CostTable | None:
        """Dynamic sharding, at the epoch's close (a round every rank reaches): every
        rank's observed costs as one table, a byte per id, combined by an all-reduce
        with MAX (odb_core.cost_table). The transport moves the bytes; the codes and
        their combination are the core's."""
        m, size = self.s.machine, self.s.table_size
        if not m.config.dynamic or size is None:
            return None
        reduce_max = getattr(self.s.transport, "reduce_max", None)
        if reduce_max is None:
            return None  # a transport without it (a test double): mean pricing
        codes = reduce_max(bytes(record(m.observed, size)), "the cost table's exchange")
        if len(codes) != size:
            raise ODBPeerError(
                f"rank {m.rank}: the cost table's exchange returned {len(codes)} codes for "
                f"{size} ids"
            )
        return CostTable(codes)

    def _save_trace(self) -> None:
        m, path = self.s.machine, self.s.trace_path
        if path is None or not isinstance(m, TracingRankMachine):
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        ProtocolTrace.from_machines([m]).save(path)


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted lists of disjoint intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo = max(xs[i][0], ys[j][0])
        hi = min(xs[i][1], ys[j][1])
        if hi > lo:
            total += hi - lo
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def _as_id(value: object, position: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        item = getattr(value, "item", None)
        value = item() if callable(item) else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise SampleError(f"sample at position {position}: id_fn returned {value!r}, not an int")
    return value
