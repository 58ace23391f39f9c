"""Several ranks of ODBDataLoader in one process: threads over an in-memory all-gather.

`ThreadTransport` is the loader's Transport for rank r of a `Hub` (one group);
`on_ranks` builds a loader per rank and runs a body on each, in threads. The
multi-rank paths (global counts, pads, merged states, the ledger exchange) then
run in a second, without spawning processes (test_torch_distributed.py does that).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from odb_core import ODBDataLoader
from odb_core.cost_table import combine
from odb_core.errors import ODBPeerError
from odb_core.step import StepInfo
from odb_core.torch.transport import LocalTransport


class Hub:
    """The all-gathers of one group of in-process ranks, keyed by their tag."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.cv = threading.Condition()
        self.rows: dict[tuple[Any, ...], dict[int, list[int]]] = {}

    def put(self, key: tuple[Any, ...], rank: int, row: list[int]) -> None:
        with self.cv:
            self.rows.setdefault(key, {})[rank] = row
            self.cv.notify_all()

    def complete(self, key: tuple[Any, ...]) -> bool:
        return len(self.rows.get(key, {})) == self.world

    def wait(self, key: tuple[Any, ...]) -> list[list[int]]:
        with self.cv:
            if not self.cv.wait_for(lambda: self.complete(key), timeout=30):
                raise ODBPeerError(f"in-process peer missing at {key}")
            return [self.rows[key][r] for r in range(self.world)]


class _Gathering:
    def __init__(self, hub: Hub, key: tuple[Any, ...]) -> None:
        self.hub, self.key = hub, key

    def done(self) -> bool:
        with self.hub.cv:
            return self.hub.complete(self.key)

    def wait(self) -> list[list[int]]:
        return self.hub.wait(self.key)


class ThreadTransport:
    timeout = 30.0

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.world_size = hub, rank, hub.world

    def start(self, tag: tuple[int, ...], vector: Sequence[int]) -> _Gathering:
        key = ("gather", *tag)
        self.hub.put(key, self.rank, list(vector))
        return _Gathering(self.hub, key)

    def exchange(
        self, tag: tuple[int, ...], ids: Sequence[int], what: str = "an exchange"
    ) -> list[list[int]]:
        key = ("ledger", *tag)
        self.hub.put(key, self.rank, list(ids))
        return self.hub.wait(key)

    def reduce_max(self, data: bytes, what: str = "an all-reduce") -> bytes:
        self.reduces = getattr(self, "reduces", 0) + 1  # every rank calls in one order
        key = ("reduce", self.reduces)
        self.hub.put(key, self.rank, list(data))
        return combine(bytes(row) for row in self.hub.wait(key))


class RankLoader(ODBDataLoader):
    """ODBDataLoader on a given transport (rank and world size come from it)."""

    def __init__(self, transport: Any, dataset: Any, **kw: Any) -> None:
        self._given_transport = transport
        super().__init__(dataset, **kw)

    def _make_transport(self, peer_timeout: float) -> Any:  # type: ignore[override]
        return self._given_transport


class Result:
    def __init__(self, loader: ODBDataLoader, infos: list[StepInfo], state: dict[str, Any]) -> None:
        self.loader, self.infos, self.state = loader, infos, state

    @property
    def ids(self) -> list[int]:
        return [i for info in self.infos for i in info.sample_ids]


Body = Callable[[ODBDataLoader], "tuple[list[StepInfo], dict[str, Any]]"]


def on_ranks(world: int, make: Callable[[Any], ODBDataLoader], body: Body) -> list[Result]:
    """Build a loader per rank on one in-memory group and run `body` on each, in threads."""
    hub = Hub(world)

    def rank(r: int) -> Result:
        loader = make(ThreadTransport(hub, r) if world > 1 else LocalTransport())
        infos, state = body(loader)
        return Result(loader, infos, state)

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank, range(world)))


def until(stop: int, epoch: int = 0) -> Body:
    def body(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
        loader.set_epoch(epoch)
        infos = []
        for _ in loader:
            assert loader.step_info is not None
            infos.append(loader.step_info)
            if len(infos) == stop:
                break
        return infos, json.loads(json.dumps(loader.state_dict()))

    return body


def to_the_end(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
    infos = []
    for _ in loader:
        assert loader.step_info is not None
        infos.append(loader.step_info)
    return infos, json.loads(json.dumps(loader.state_dict()))
