"""What runs inside DataLoader workers: fetch processed samples, tagged with ids.

The inner loader is a plain `torch.utils.data.DataLoader(batch_size=None)`; each
item it yields is a short list of records `(sample_id, sample)` or a
`LoadFailure`. Fetching a few samples per item amortises the worker-to-main
IPC; the order is still the sampler's order. Exceptions in the user's dataset
become records so the main process raises them naming the sample id.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from odb_core.errors import ConfigError, ODBError
from odb_core.torch.wire import Packed, pack


class LoadFailure(NamedTuple):
    sample_id: int
    error_type: str
    message: str
    traceback: str


Record = tuple[int, Any] | LoadFailure


class SampleLoadError(ODBError, RuntimeError):
    """The user's dataset raised while producing a sample; names the sample id."""

    def __init__(self, failure: LoadFailure) -> None:
        self.sample_id = failure.sample_id
        self.error_type = failure.error_type
        super().__init__(
            f"the dataset raised {failure.error_type}: {failure.message} while loading "
            f"sample {failure.sample_id}\n--- dataset traceback ---\n{failure.traceback}"
        )


def _failure(sample_id: int, exc: BaseException) -> LoadFailure:
    return LoadFailure(sample_id, type(exc).__name__, str(exc), traceback.format_exc())


def read_sample(dataset: Any, sample_id: int) -> Any:
    """`dataset[sample_id]` read in this process (a length estimate, a profile, a pad
    batch's shape): a dataset error is raised as the loader's `SampleLoadError`
    naming the id, as when the loader's own reader meets it."""
    try:
        return dataset[sample_id]
    except Exception as exc:
        raise SampleLoadError(_failure(sample_id, exc)) from exc


def _ship(records: list[Record]) -> list[Record] | Packed:
    # In a worker process records cross a process boundary: pack them (see wire.py).
    return records if get_worker_info() is None else pack(records)


def identity(x: Any) -> Any:
    """collate_fn of the inner loader (module level, so spawn can pickle it)."""
    return x


class WorkerGuard:
    """The inner loader's `worker_init_fn`: first ties the worker to its rank, then
    calls the user's `worker_init_fn`.

    - A forked worker closes its copies of the rank's gloo sockets (`inodes`, set by
      the loader from the transport). Otherwise the sockets of a killed rank stay
      open in its workers, and its peers notice the death only when the workers go.
    - A thread exits the worker as soon as the rank process (`owner`) is gone, by
      any start method (a forkserver worker's parent is the forkserver, so torch's
      parent watchdog does not see the rank die).
    """

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn
        self.owner = os.getpid()
        self.inodes: frozenset[str] = frozenset()

    def __call__(self, worker_id: int) -> None:
        if self.inodes:
            _close_sockets(self.inodes)
        threading.Thread(
            target=_exit_with, args=(self.owner,), name="odb-owner-watch", daemon=True
        ).start()
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _close_sockets(inodes: frozenset[str]) -> None:
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}") in inodes:
                    os.close(int(name))


def _exit_with(owner: int) -> None:
    try:
        fd = os.pidfd_open(owner)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        select.select([fd], [], [])
    else:
        while True:
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                break
            except OSError:
                pass
            time.sleep(0.5)
    os._exit(1)


class IndexChunks(Sampler[list[int]]):
    """Yields this rank's indices for the epoch, `chunk` at a time. The loader
    sets `indices` before each `iter()` of the inner DataLoader (which also works
    with persistent workers: the sampler lives in the main process)."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.indices: list[int] = []

    def __iter__(self) -> Iterator[list[int]]:
        idx, c = self.indices, self.chunk
        for start in range(0, len(idx), c):
            yield idx[start : start + c]

    def __len__(self) -> int:
        return -(-len(self.indices) // self.chunk)


class MapSource(Dataset[list[Record] | Packed]):
    """Map-style wrapper: `source[[i, j, ...]]` returns the records of those indices."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, chunk: Sequence[int]) -> list[Record] | Packed:
        out: list[Record] = []
        for i in chunk:
            try:
                out.append((i, self.dataset[i]))
            except Exception as exc:
                out.append(_failure(i, exc))
                break
        return _ship(out)

    def __len__(self) -> int:
        return len(self.dataset)


def shards_by_worker(dataset: object) -> bool:
    """Whether `dataset` splits itself across DataLoader workers: HF `datasets`'
    IterableDataset does (`n_shards` shards dealt to the workers), by its module
    name, so that `datasets` is never imported here."""
    return type(dataset).__module__.split(".")[0] == "datasets" and hasattr(dataset, "n_shards")


class IterSource(IterableDataset[list[Record] | Packed]):
    """IterableDataset wrapper, sharded by rank and worker.

    With `partition`, every rank's every worker reads the stream and keeps the
    elements at global positions p with p % world == rank and
    (p // world) % workers == worker; the id of an element is p, stable for any
    world size. Without it, the dataset is taken as already this rank's (and this
    worker's) stream; ids are then unique across ranks and workers for one world
    size and worker count.
    """

    def __init__(self, dataset: Any, rank: int, world: int, partition: bool, chunk: int) -> None:
        self.dataset = dataset
        self.rank = rank
        self.world = world
        self.partition = partition
        self.chunk = chunk

    def __iter__(self) -> Iterator[list[Record] | Packed]:
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        rank, world, chunk = self.rank, self.world, self.chunk
        buf: list[Record] = []
        p = 0
        try:
            if self.partition and workers > 1 and shards_by_worker(self.dataset):
                raise ConfigError(
                    f"a streamed datasets.IterableDataset ({type(self.dataset).__name__}) "
                    "hands each DataLoader worker only its own shards, so with partition=True "
                    f"(every worker reads the whole stream) {workers} workers would drop samples: "
                    "split it by node yourself (datasets.distributed.split_dataset_by_node) and "
                    "pass partition=False with id_fn=, or num_workers=0 or 1"
                )
            it = iter(self.dataset)
        except Exception as exc:
            yield _ship([_failure(0, exc)])
            return
        while True:
            sid = p if self.partition else (p * workers + worker) * world + rank
            try:
                item = next(it)
            except StopIteration:
                break
            except Exception as exc:
                yield _ship([*buf, _failure(sid, exc)])
                return
            if not self.partition or (p % world == rank and (p // world) % workers == worker):
                buf.append((sid, item))
                if len(buf) >= chunk:
                    yield _ship(buf)
                    buf = []
            p += 1
        if buf:
            yield _ship(buf)
