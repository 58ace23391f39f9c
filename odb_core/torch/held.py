"""What the loader holds in host memory: the size of each preprocessed sample, the
tally of the samples it holds between their arrival and their collation, and the
error when the workers' shared memory runs out.

A preprocessed VLM sample carries megabytes of `pixel_values`; DataLoader workers
hand it over through shared memory, so what the loader holds sits in /dev/shm,
outside every process's RSS. The loader measures each sample once, as it arrives
(`tensor_bytes`), counts it until its batch is collated (`HeldBytes`), and the core
bounds the window by those counts (`ProtocolConfig.window_bytes`).
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from odb_core.errors import ODBError

__all__ = [
    "HeldBytes",
    "SharedMemoryError",
    "note_worker_exits",
    "shared_memory_error",
    "tensor_bytes",
]


def tensor_bytes(raw: Any) -> int:
    """Bytes of the tensors and arrays in a sample (nested in dicts, lists and
    tuples); other values count 0."""
    if isinstance(raw, torch.Tensor):
        return raw.numel() * raw.element_size()
    if isinstance(raw, Mapping):
        return sum(tensor_bytes(v) for v in raw.values())
    if isinstance(raw, (list, tuple)):
        return sum(tensor_bytes(v) for v in raw)
    nbytes = getattr(raw, "nbytes", None)  # numpy arrays, without importing numpy
    return nbytes if isinstance(nbytes, int) and not isinstance(nbytes, bool) else 0


class HeldBytes:
    """The running tally of held samples by id, with peak and mean."""

    def __init__(self, bound: int | None, *, advise_over: int | None = None, rank: int = 0) -> None:
        self.bound = bound
        # Unbounded in bytes (dynamic sharding): warn once when the tally passes this.
        self._advise_over = advise_over if bound is None else None
        self._rank = rank
        self.sizes: dict[int, int] = {}
        self.bytes = 0
        self._peak_bytes = 0
        self._peak_samples = 0
        self._sum_bytes = 0
        self._sum_samples = 0
        self._arrivals = 0
        self._unnamed = 0  # arrived, not yet held under their id

    def arrive(self, n: int) -> None:
        """A sample of `n` bytes came from the source (not yet named)."""
        self._unnamed += 1
        self.bytes += n
        self._arrivals += 1
        held = self.samples
        self._peak_bytes = max(self._peak_bytes, self.bytes)
        self._peak_samples = max(self._peak_samples, held)
        self._sum_bytes += self.bytes
        self._sum_samples += held
        if self._advise_over is not None and self.bytes >= self._advise_over:
            self._advise_over = None
            warnings.warn(unbounded_advice(self._rank, held, self.bytes), stacklevel=2)

    def name(self, sample_id: int, n: int) -> None:
        """An arrived sample is held under its id (until `release`)."""
        self._unnamed -= 1
        self.sizes[sample_id] = self.sizes.get(sample_id, 0) + n

    def forget(self, n: int) -> None:
        """An arrived sample is dropped before it is named (skipped, failed)."""
        self._unnamed -= 1
        self.bytes -= n

    def release(self, sample_id: int) -> None:
        self.bytes -= self.sizes.pop(sample_id, 0)

    def clear(self) -> None:
        self.sizes.clear()
        self._unnamed = 0
        self.bytes = 0

    @property
    def samples(self) -> int:
        return len(self.sizes) + self._unnamed

    @property
    def full(self) -> bool:
        return self.bound is not None and self.bytes >= self.bound

    def stats(self) -> dict[str, Any]:
        """`EpochStats`' window fields: peaks and means over the moments a sample
        arrived, and the bound."""
        n = max(self._arrivals, 1)
        return {
            "window_bytes_peak": self._peak_bytes,
            "window_bytes_mean": self._sum_bytes / n,
            "window_samples_peak": self._peak_samples,
            "window_samples_mean": self._sum_samples / n,
            "window_bytes_bound": self.bound,
        }


def unbounded_advice(rank: int, samples: int, nbytes: int) -> str:
    """The warning for a window past the default byte bound where no byte bound is
    in force: dynamic sharding bounds a rank's window in samples only."""
    return (
        f"ODBDataLoader rank {rank}: the loader holds {samples} preprocessed samples, "
        f"{nbytes:,} bytes, with no byte bound: dynamic sharding bounds the window in "
        "samples (buffer_size=), not bytes. Where host memory or /dev/shm is short "
        "(images, video), pass window_bytes= (static sharding, the window bounded in "
        "bytes) or a smaller buffer_size=."
    )


class SharedMemoryError(ODBError, RuntimeError):
    """The DataLoader workers ran out of shared memory (/dev/shm)."""


_SHM_SIGNS = ("shared memory", "bus error", "/dev/shm", "</torch_", "shm")


def note_worker_exits(exc: BaseException, iterator: object) -> None:
    """Add the signals that killed the DataLoader's workers to torch's "DataLoader
    worker (pid(s) N) exited unexpectedly", which names none: torch raises it instead
    of "killed by signal: Bus error" when its data-queue read sees the worker's
    connection reset before its SIGCHLD handler runs. Read from the multi-process
    iterator's `_workers` (torch's own, unlisted: its `Process` objects); a no-op for
    any other error or iterator."""
    if "exited unexpectedly" not in str(exc):
        return
    exits = [getattr(w, "exitcode", None) for w in getattr(iterator, "_workers", ())]
    names = sorted({_signal_name(-code) for code in exits if code is not None and code < 0})
    if names:
        note = f"DataLoader worker exit signals: {', '.join(names)}"
        if note not in getattr(exc, "__notes__", ()):
            exc.__dict__.setdefault("__notes__", []).append(note)  # add_note, on 3.10 too


def _signal_name(number: int) -> str:
    try:
        sig = signal.Signals(number)
    except ValueError:
        return f"signal {number}"
    desc = signal.strsignal(sig) or sig.name
    return f"{sig.name} ({desc.lower()})"


def shared_memory_error(
    exc: BaseException, *, rank: int, held: HeldBytes, samples_per_fetch: int
) -> SharedMemoryError | None:
    """The loader's own error for torch's out-of-shared-memory failures (a worker
    killed by SIGBUS, `unable to write to file </torch_...>`), naming what the loader
    held and the settings that shrink it; None for any other error."""
    if isinstance(exc, ODBError) or not isinstance(exc, (RuntimeError, OSError)):
        return None
    text = " ".join([str(exc), *getattr(exc, "__notes__", ())]).lower()
    if not any(sign in text for sign in _SHM_SIGNS):
        return None
    bound = "unbounded" if held.bound is None else f"window_bytes={held.bound:,}"
    return SharedMemoryError(
        f"ODBDataLoader rank {rank}: the DataLoader workers ran out of shared memory "
        f"(/dev/shm) while the loader held {held.samples} preprocessed samples, "
        f"{held.bytes:,} bytes ({bound}). Lower window_bytes= (the window's byte bound), "
        f"or samples_per_fetch= ({samples_per_fetch}) / prefetch_factor= / num_workers=, "
        "or give the container more shared memory (docker run --shm-size=...). "
        f"torch said: {exc}"
    )
