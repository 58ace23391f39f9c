"""One epoch of the loader: the runner of its round loop (torch/rounds.py).

By default the loop runs on a thread and hands steps over through a queue, at
most `ROUNDS_AHEAD` rounds ahead of what the training loop has taken; with
`prefetch_thread=False` it runs inline, in the thread that iterates. The runner
hands steps and the epoch's end to the training loop, turns a failure into the
error every rank raises alike (telling the peers first), and releases the inner
DataLoader's workers when the epoch ends or the loop lets it go.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

from odb_core.errors import ODBError, ODBPeerError
from odb_core.protocol import RankPhase
from odb_core.torch.held import note_worker_exits, shared_memory_error
from odb_core.torch.rounds import Emitted, EpochSetup, RoundLoop, _End, _Failure

__all__ = ["EpochPipeline"]


class EpochPipeline(RoundLoop):
    """Drives `_rounds()`, the epoch's protocol loop: on a thread that runs up to
    ROUNDS_AHEAD rounds ahead of the training loop, or inline in the thread that
    iterates (round r+1's all-gather is then issued before round r's steps are
    handed out, so it still overlaps training)."""

    def __init__(self, setup: EpochSetup, *, threaded: bool) -> None:
        super().__init__(setup, threaded=threaded)
        self._end: _End | None = None
        self._finished = False
        self._peer_failure: _Failure | None = None
        self._reported = False
        self._gen = self._rounds()
        self._releaser: threading.Thread | None = None  # drops the source after a failure
        # Inline, no thread object at all: a never-started Thread keeps its target (this
        # pipeline) in a reference cycle, which only the cyclic GC frees, and torch's
        # worker shutdown under the GC waits out its 5 s join timeout per worker.
        self._thread: threading.Thread | None = (
            threading.Thread(target=self._run, name="odb-protocol", daemon=True)
            if threaded
            else None
        )

    # ---- training-loop side ------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()

    def get(self) -> Emitted | _End:
        if self._threaded:
            try:
                # A peer failure, once known, goes ahead of the steps still queued.
                item = self._peer_failure or self._queue.get_nowait()
            except queue.Empty:
                start = time.perf_counter()
                try:
                    item = self._wait_item()
                except Exception as error:  # e.g. torch's "worker exited unexpectedly"
                    shm = self._explain(error)
                    self._fail(_Failure(shm))
                    flush = getattr(self.s.transport, "flush", None)
                    if callable(flush):
                        flush(1.0)
                    if shm is not error:
                        raise shm from error
                    raise
                self._stall_spans.append((start, time.perf_counter()))
        else:
            start = time.perf_counter()
            item = self._next_inline()
            self._stall_spans.append((start, time.perf_counter()))
        if isinstance(item, _Failure):
            flush = getattr(self.s.transport, "flush", None)
            if callable(flush):
                flush(1.0)  # the peers learn why before this process may exit
            exc = item.exc
            del item
            try:
                raise exc
            finally:
                # No exc -> traceback -> this frame -> exc cycle: it would keep the inner
                # DataLoader iterator for the cyclic GC, whose finalisation order makes
                # torch's worker shutdown wait out its timeout.
                del exc
        if isinstance(item, Emitted):
            with self._cv:
                self._taken += 1
                self._cv.notify_all()
        return item

    @property
    def alive(self) -> bool:
        look, thread = self._look, self._thread
        return (thread is not None and thread.is_alive()) or (look is not None and look.alive)

    def _wait_item(self) -> Emitted | _Failure | _End:
        t = self.s.transport
        verdict = getattr(t, "verdict", None)
        patience = float(getattr(t, "timeout", 0.0))
        start = time.monotonic()
        with contextlib.ExitStack() as stack:
            while True:
                item = self._wait_once(verdict)
                if item is not None:
                    return item
                if patience and time.monotonic() - start > patience and hasattr(t, "waiting"):
                    # Waited past peer_timeout: read the peers' heartbeats too, so a
                    # rank stuck in its own pipeline raises once its peers are gone.
                    stack.enter_context(t.waiting())
                    patience = 0.0

    def _wait_once(self, verdict: Any) -> Emitted | _Failure | _End | None:
        try:
            return self._queue.get(timeout=0.1)
        except queue.Empty:
            if self._peer_failure is not None:
                return self._peer_failure
            thread = self._thread
            if (thread is None or not thread.is_alive()) and self._queue.empty():
                raise ODBError("the loader's protocol thread ended without a result") from None
            # The protocol thread may be stuck in this rank's own data pipeline (a
            # hung worker): raise once a peer failed and said so, or the store's host
            # is gone. Not after the epoch's last round: the close raises alike.
            if self.s.machine.phase is RankPhase.DONE or not callable(verdict):
                return None
            known = verdict()
            return None if known is None else _Failure(known)

    def _next_inline(self) -> Emitted | _Failure | _End:
        if self._end is not None:
            return self._end
        final: _End | _Failure
        try:
            return next(self._gen)
        except StopIteration as stop:
            final = stop.value
        except BaseException as exc:
            final = _Failure(self._explain(exc))
        if isinstance(final, _Failure):
            self._fail(final)
        final = self._finish(final)
        if isinstance(final, _End):
            self._end = final
        return final

    def close(self, timeout: float | None = None) -> None:
        """Stop after the rounds every rank issues anyway (see module docstring), and
        wait (up to `timeout` each) for the protocol thread and for the source's
        workers to be released."""
        self._stop()
        thread = self._thread
        if thread is not None:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout)
            if self._look is not None:
                # Its reader must not be inside the inner iterator when the next epoch
                # resets it (persistent workers reuse one iterator).
                self._look.close(timeout)
        elif not self._finished:
            try:
                self._gen.close()
            finally:
                self._finish(_Failure(ODBError("the loader was closed before the epoch ended")))
        releaser = self._releaser
        if releaser is not None and releaser is not threading.current_thread():
            releaser.join(timeout)

    def abandon(self) -> None:
        """The training loop dropped its iterator: nothing can take a step from this
        pipeline any more, so stop it as `close` would, without waiting for the
        protocol thread (it ends by itself after the rounds every rank issues
        anyway, and releases the source's workers as it ends). Inline, that is the
        close itself, without waiting either. Without this an abandoned pipeline
        would hold its thread (blocked at the gate) and the inner DataLoader's
        workers until the loader is iterated again or closed, or for the life of
        the process."""
        if self._thread is not None:
            self._stop()
            return
        with contextlib.suppress(ValueError):  # ValueError: the generator is running
            self.close(timeout=0.0)  # the workers are released on a thread of their own

    def _stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    # ---- the protocol loop -----------------------------------------------------

    def _run(self) -> None:
        final: _End | _Failure
        try:
            while True:
                self._queue.put(next(self._gen))
        except StopIteration as stop:
            final = stop.value
        except BaseException as exc:
            final = _Failure(self._explain(exc))
        if isinstance(final, _Failure):
            # Hand the failure over first: the inner loader's workers shut down after.
            self._fail(final)
            self._queue.put(final)
            self._finish(final)
            del final
            return
        final = self._finish(final)
        # Last: once the loop sees the end, the process may exit at once.
        self._queue.put(final)
        del final

    def _explain(self, exc: BaseException) -> BaseException:
        """torch's out-of-shared-memory failures as the loader's own error, naming
        what it held and the settings to change (torch/held.py); others unchanged."""
        note_worker_exits(exc, self.s.source)
        shm = shared_memory_error(
            exc, rank=self.s.machine.rank, held=self._held, samples_per_fetch=self.s.fetch
        )
        if shm is None:
            return exc
        shm.__cause__ = exc
        return shm

    def _fail(self, failure: _Failure) -> None:
        if self._stopping and isinstance(failure.exc, ODBError):
            return  # closed by the loop (or its peers' close), not a fault
        if isinstance(failure.exc, ODBPeerError):
            self._peer_failure = failure
        report = getattr(self.s.transport, "report", None)
        if callable(report) and not self._reported:
            self._reported = True
            report(failure.exc)

    def _finish(self, final: _End | _Failure) -> _End | _Failure:
        self._finished = True
        # Release the inner iterator now (it shuts its workers down unless they are
        # persistent, which the DataLoader itself keeps alive); after a failure on a
        # background thread, so that the error does not wait for the workers (close()
        # waits for that thread).
        holder = [self.s.source]
        self.s.source = iter(())
        if self._look is not None:
            self._look.close()  # its reader drops the inner iterator as it ends
        if isinstance(final, _Failure):
            self._releaser = threading.Thread(
                target=holder.clear, name="odb-release-workers", daemon=True
            )
            self._releaser.start()
        else:
            holder.clear()
        del holder
        try:
            self._save_trace()
        except OSError as exc:
            if isinstance(final, _End):
                return _Failure(exc)
        return final
