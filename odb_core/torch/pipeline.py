"""One epoch of the loader: the protocol loop that drives the rank's machine.

The loop pulls processed samples from the inner DataLoader, feeds them to the
`RankMachine`, moves each round's vector through the transport, and collates the
agreed steps for the training loop. Every batching decision is the machine's;
this module only does I/O. By default the loop runs on a thread and hands steps
over through a queue; with `prefetch_thread=False` it runs inline, in the thread
that iterates the loader.

Overlap and determinism. The thread may run at most `ROUNDS_AHEAD` rounds ahead
of what the training loop has taken: it issues round r's all-gather only once
the loop has taken every step of round r - ROUNDS_AHEAD - 1 (inline, round r+1's
all-gather is issued when the loop asks for round r's first step). Since every
rank runs the same steps per round, the rounds a rank has issued are a function
of the steps its loop has taken, identical on all ranks; a loop that stops early
at the same step on every rank leaves no half-issued collective behind. The
all-gather of round r+1 is in flight while the loop trains on round r, and the
loop observes more samples into the window while it waits (the machine allows
prefetch in its WAITING phase).

Quota-mode close. When the final round lands, the rank's ledger (its window and
ready batches at the close, plus the ids of its source order it never delivered)
is all-gathered in one extra collective, right after that round's all-gather on
every rank, and the per-rank ledgers ride on the epoch's last step (and its
end), so a `state_dict()` taken after the last batch already holds them.
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

from odb_core.config import Mode
from odb_core.errors import ConfigError, ODBError, ODBPeerError, SampleError
from odb_core.ledger import Ledgers, validate_ledgers
from odb_core.protocol import Contribution, RankMachine, StepInfo
from odb_core.sample import Sample
from odb_core.torch.measure import CostFn, TruncateFn, default_truncate, measure
from odb_core.torch.source import LoadFailure, Record, SampleLoadError
from odb_core.torch.transport import Gathering, Transport
from odb_core.torch.wire import Packed, unpack
from odb_core.trace import ProtocolTrace, TracingRankMachine

ROUNDS_AHEAD = 2


class Emitted(NamedTuple):
    info: StepInfo
    batch: Any
    last_of_round: bool
    last_of_epoch: bool
    ledger: Ledgers = ()  # on the last step of the epoch: every rank's ledger


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
    """

    rounds: int
    collectives: int
    round_wait_s: tuple[float, ...]
    collective_stall_s: float
    stall_s: float


class _End(NamedTuple):
    ledger: Ledgers  # every rank's ids not emitted (quota mode), in rank order
    stats: EpochStats


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
    id_fn: Callable[[Any], object] | None
    truncate_fn: TruncateFn | None
    pin: Callable[[Any], Any] | None
    pad_fallback: Callable[[], Any]
    shard: list[int] | None  # map-style: this rank's source order, for the quota ledger
    trace_path: Path | None


class PadTemplate:
    """The raw sample a pad step collates: the shortest real sample seen so far."""

    def __init__(self) -> None:
        self.sample: Any = None
        self.length = -1

    def offer(self, raw: Any, length: int) -> None:
        if self.length < 0 or length < self.length:
            self.sample, self.length = raw, length


class EpochPipeline:
    """Drives `_rounds()`, the epoch's protocol loop: on a thread that runs up to
    ROUNDS_AHEAD rounds ahead of the training loop, or inline in the thread that
    iterates (round r+1's all-gather is then issued before round r's steps are
    handed out, so it still overlaps training)."""

    def __init__(self, setup: EpochSetup, pad: PadTemplate, *, threaded: bool) -> None:
        self.s = setup
        self._pad = pad
        self._threaded = threaded
        self._queue: queue.Queue[Emitted | _Failure | _End] = queue.Queue()
        self._cv = threading.Condition()
        self._taken_rounds = 0
        self._stopping = False
        self._pending: deque[Record] = deque()
        self._raw: dict[int, Any] = {}
        self._tokens: dict[int, int] = {}  # measured text tokens, before any truncation
        self._emitted_ids: set[int] = set()
        self._collective_spans: list[tuple[float, float]] = []
        self._stall_spans: list[tuple[float, float]] = []
        self._collectives = 0
        self._in_flight: Gathering | None = None
        self._end: _End | None = None
        self._finished = False
        self._gen = self._rounds()
        self._thread = threading.Thread(target=self._run, name="odb-protocol", daemon=True)

    # ---- training-loop side ------------------------------------------------

    def start(self) -> None:
        if self._threaded:
            self._thread.start()

    def get(self) -> Emitted | _End:
        if self._threaded:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                start = time.perf_counter()
                item = self._wait_item()
                self._stall_spans.append((start, time.perf_counter()))
        else:
            start = time.perf_counter()
            item = self._next_inline()
            self._stall_spans.append((start, time.perf_counter()))
        if isinstance(item, _Failure):
            exc = item.exc
            del item
            try:
                raise exc
            finally:
                # No exc -> traceback -> this frame -> exc cycle: it would keep the inner
                # DataLoader iterator for the cyclic GC, whose finalisation order makes
                # torch's worker shutdown wait out its timeout.
                del exc
        if isinstance(item, Emitted) and item.last_of_round:
            with self._cv:
                self._taken_rounds += 1
                self._cv.notify_all()
        return item

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _wait_item(self) -> Emitted | _Failure | _End:
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise ODBError("the loader's protocol thread ended without a result") from None

    def _next_inline(self) -> Emitted | _Failure | _End:
        if self._end is not None:
            return self._end
        final: _End | _Failure
        try:
            return next(self._gen)
        except StopIteration as stop:
            final = stop.value
        except BaseException as exc:
            final = _Failure(exc)
        final = self._finish(final)
        if isinstance(final, _End):
            self._end = final
        return final

    def close(self, timeout: float | None = None) -> None:
        """Stop after the rounds every rank issues anyway (see module docstring)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._threaded:
            if self._thread.is_alive() and self._thread is not threading.current_thread():
                self._thread.join(timeout)
            return
        if not self._finished:
            try:
                self._gen.close()
            finally:
                self._finish(_Failure(ODBError("the loader was closed before the epoch ended")))

    # ---- the protocol loop -----------------------------------------------------

    def _run(self) -> None:
        final: _End | _Failure
        try:
            while True:
                self._queue.put(next(self._gen))
        except StopIteration as stop:
            final = stop.value
        except BaseException as exc:
            final = _Failure(exc)
        final = self._finish(final)
        # Last: once the loop sees the end, the process may exit at once.
        self._queue.put(final)
        del final

    def _finish(self, final: _End | _Failure) -> _End | _Failure:
        self._finished = True
        # Release the inner iterator now (it shuts its workers down unless they are
        # persistent, which the DataLoader itself keeps alive).
        self.s.source = iter(())
        try:
            self._save_trace()
        except OSError as exc:
            if isinstance(final, _End):
                return _Failure(exc)
        return final

    def _gate(self, r: int) -> bool:
        if not self._threaded:
            return True  # the training loop drives
        with self._cv:
            while r > self._taken_rounds + ROUNDS_AHEAD and not self._stopping:
                self._cv.wait()
            return r <= self._taken_rounds + ROUNDS_AHEAD

    def _rounds(self) -> Generator[Emitted, None, _End | _Failure]:
        m, t = self.s.machine, self.s.transport
        steps_per_round = m.config.max_steps_per_round
        deferred: list[Emitted] = []
        r = 0
        try:
            while self._gate(r):
                c = m.fill(self._pull)
                gathering = self._in_flight = t.start(
                    (*self.s.tag, r), c.to_vector(steps_per_round)
                )
                yield from deferred
                deferred = []
                while m.needs_sample and not self._stopping and not gathering.done():
                    sample = self._pull()
                    if sample is None:
                        m.exhaust()
                    else:
                        m.observe(sample)
                start = time.perf_counter()
                try:
                    rows = gathering.wait()
                finally:
                    self._in_flight = None
                    self._collective_spans.append((start, time.perf_counter()))
                    self._collectives += 1
                result = m.all_gather([Contribution.from_vector(v, steps_per_round) for v in rows])
                steps = self._emit(result.steps, result.done)
                if result.done:
                    ledger = self._exchange(self._ledger(result.carried), m.round)
                    if steps:
                        steps[-1] = steps[-1]._replace(ledger=ledger)
                    yield from steps
                    return _End(ledger, self._stats(m.round))
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

    def _emit(self, infos: tuple[StepInfo, ...], done: bool) -> list[Emitted]:
        out = []
        n = len(infos)
        for j, info in enumerate(infos):
            self._emitted_ids.update(info.sample_ids)
            batch = None if self._stopping else self._collate(info)
            if self.s.step_offset:
                info = dataclasses.replace(info, step=info.step + self.s.step_offset)
            out.append(Emitted(info, batch, j == n - 1, done and j == n - 1))
        return out

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
        )

    def _pull(self) -> Sample | None:
        while True:
            if not self._pending:
                chunk = next(self.s.source, None)
                if chunk is None:
                    return None
                self._pending.extend(unpack(chunk) if isinstance(chunk, Packed) else chunk)
                continue
            rec = self._pending.popleft()
            if isinstance(rec, LoadFailure):
                raise SampleLoadError(rec)
            sid, raw = rec
            if self.s.id_fn is not None:
                sid = _as_id(self.s.id_fn(raw), sid)
            if sid in self.s.excluded:
                continue
            sample = measure(raw, sid, self.s.cost_fn)
            self._raw[sid] = raw
            self._tokens[sid] = sample.tokens
            self._pad.offer(raw, sample.length)
            return sample

    def _collate(self, info: StepInfo) -> Any:
        if info.batch is None:
            raw = self._pad.sample if self._pad.length >= 0 else self.s.pad_fallback()
            batch = self.s.collate([raw])
        else:
            raws = [self._raw.pop(i) for i in info.sample_ids]
            original = {i: self._tokens.pop(i) for i in info.sample_ids}
            if info.truncated:
                raws = self._truncate(info, raws, original)
            batch = self.s.collate(raws)
        return batch if self.s.pin is None else self.s.pin(batch)

    def _truncate(self, info: StepInfo, raws: list[Any], original: dict[int, int]) -> list[Any]:
        # The batch's Sample carries the kept token count the machine decided.
        assert info.batch is not None
        cut = {i for i, _ in info.truncated}
        out = []
        for s, raw in zip(info.batch.samples, raws, strict=True):
            if s.id in cut:
                if self.s.truncate_fn is not None:
                    raw = self.s.truncate_fn(raw, s.tokens)
                else:
                    raw = default_truncate(raw, s.tokens, original[s.id], s.id)
            out.append(raw)
        return out

    def _ledger(self, carried: tuple[Sample, ...]) -> tuple[int, ...]:
        """Ids of this rank's epoch not emitted (quota mode): carried by the close,
        plus, for map-style data, those never pulled; in source order, which is
        the order the next epoch takes them in."""
        self._raw.clear()
        self._tokens.clear()
        if self.s.shard is None:
            return tuple(s.id for s in carried)
        done = self._emitted_ids | self.s.excluded
        return tuple(i for i in self.s.shard if i not in done)

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
