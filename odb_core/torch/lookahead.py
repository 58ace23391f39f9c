"""The rank's source read on its own thread, so the protocol loop can look, without
blocking, whether its next processed sample is there (early forms, issue 24).

`LookAhead` wraps the inner DataLoader's iterator: a reader thread takes its
chunks (unpacked, so every record is counted) into a small queue; the protocol
thread reads them from the queue as it would from the iterator. `ready()` says
whether the next chunk (or the end, or an error) is already queued; `wait_s(n)`
estimates how long the workers take to deliver `n` more samples, from the time
the reader spent waiting in the inner iterator per sample it got (the measured
arrival rate while the source, not the consumer, is the bottleneck; inf before
the first sample).

This is observation only: the decision to form early is the core's
(`RankAction.FORM_EARLY in machine.enabled()`), taken by `EpochPipeline` when
`early_form_decision` says the rest of the window is not there and would take
longer than `early_form_wait` seconds. Public DataLoader API only: the iterator is
iterated, nothing private is read.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from odb_core.errors import ODBError
from odb_core.torch.held import note_worker_exits
from odb_core.torch.source import Record
from odb_core.torch.wire import Packed, unpack

DEPTH = 4  # chunks the reader may hold ahead of the protocol thread


class _Raised(NamedTuple):
    exc: BaseException


_END = object()


class LookAhead(Iterator[list[Record]]):
    """An iterator over `source`'s chunks, read ahead on a daemon thread."""

    def __init__(self, source: Iterator[list[Record] | Packed], depth: int = DEPTH) -> None:
        self._source: Iterator[list[Record] | Packed] | None = source
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._ended = False
        self.samples = 0  # delivered by the reader so far
        self.busy_s = 0.0  # time the reader spent inside the inner iterator
        self._thread = threading.Thread(target=self._read, name="odb-lookahead", daemon=True)
        self._thread.start()

    # ---- reader thread -------------------------------------------------------

    def _read(self) -> None:
        src = self._source
        assert src is not None
        try:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    chunk = next(src)
                except StopIteration:
                    self._put(_END)
                    return
                except BaseException as exc:
                    note_worker_exits(exc, src)  # while its workers are at hand
                    self._put(_Raised(exc))
                    return
                records = unpack(chunk) if isinstance(chunk, Packed) else chunk
                self.busy_s += time.perf_counter() - start
                self.samples += len(records)
                if not self._put(records):
                    return
        finally:
            # Drop the inner iterator here: its workers shut down (unless persistent).
            self._source = None
            del src

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    # ---- protocol thread ----------------------------------------------------

    def __next__(self) -> list[Record]:
        while True:
            if self._ended:
                raise StopIteration
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if self._stop.is_set():  # closed: the reader puts nothing more
                    raise ODBError("the loader's source was closed mid-epoch") from None
        if item is _END:
            self._ended = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._ended = True
            exc = item.exc
            del item
            raise exc
        records: list[Record] = item
        return records

    def ready(self) -> bool:
        """Whether the next chunk, the end or an error is already here (no blocking)."""
        return self._ended or not self._queue.empty()

    def wait_s(self, samples: int) -> float:
        """Estimated seconds until `samples` more samples arrive (inf before the first)."""
        if samples <= 0:
            return 0.0
        if self.samples == 0:
            return math.inf
        return samples * self.busy_s / self.samples

    def close(self, timeout: float | None = None) -> None:
        """Stop the reader (after the chunk it is waiting for) and drop what it holds;
        with `timeout`, wait that long for it to end."""
        self._stop.set()
        self._drain()
        if timeout is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            self._drain()  # what a put under way left

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def early_form_decision(
    look: LookAhead, pending: int, missing: int, wait_s: float, queued: int = 0
) -> bool:
    """The observation the torch driver gives the core's FORM_EARLY: the training loop
    has no step waiting for it (`queued`: steps handed over and not yet taken), the
    next sample is not there (`pending` records already fetched and none queued) and
    the `missing` samples of the window would take longer than `wait_s` seconds to
    arrive. (The protocol thread outruns the workers whenever it is not gated, so
    "the next sample is not there" alone holds nearly always while it fills; an
    early form pays padding, worth it only when the loop would otherwise wait.)"""
    if queued or pending or look.ready():
        return False
    return look.wait_s(missing) > wait_s
