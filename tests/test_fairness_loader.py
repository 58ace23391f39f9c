"""Cross-epoch fairness through ODBDataLoader (proofs/cross_epoch_fairness.md): the
issue's setting (600 samples, quota 400, 8 passes) holds with ranks in threads of one
process. The pure checks (former, two-pass model check, fuzz, RankMachines) are in
tests/test_fairness.py and run without torch."""

from __future__ import annotations

import statistics
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from guards import HANG_GUARD_S

from odb_core.verify.fairness import long_tail

torch = pytest.importorskip("torch")

from torch.utils.data import Dataset  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.torch.transport import LocalTransport  # noqa: E402

pytestmark = pytest.mark.torch


class Lengths(Dataset[dict[str, Any]]):
    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": [0] * self.lengths[i]}


class Hub:
    """An in-memory all-gather for ranks running in threads of one process."""

    def __init__(self, world: int) -> None:
        self.world, self.cv, self.rows = world, threading.Condition(), {}  # type: ignore[var-annotated]

    def gather(self, key: tuple[Any, ...], rank: int, row: list[int]) -> list[list[int]]:
        with self.cv:
            self.rows.setdefault(key, {})[rank] = row
            self.cv.notify_all()
            assert self.cv.wait_for(lambda: len(self.rows[key]) == self.world, timeout=HANG_GUARD_S)
            return [self.rows[key][r] for r in range(self.world)]


class _Done:
    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def done(self) -> bool:
        return True

    def wait(self) -> list[list[int]]:
        return self.rows


class HubTransport:
    timeout = 60.0

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.world_size = hub, rank, hub.world

    def start(self, tag: tuple[int, ...], vector: Sequence[int]) -> _Done:
        return _Done(self.hub.gather(("round", *tag), self.rank, list(vector)))

    def exchange(
        self, tag: tuple[int, ...], ids: Sequence[int], what: str = "an exchange"
    ) -> list[list[int]]:
        return self.hub.gather(("ledger", *tag), self.rank, list(ids))


class HubLoader(ODBDataLoader):
    def __init__(self, transport: Any, dataset: Any, **kw: Any) -> None:
        self._given = transport
        super().__init__(dataset, **kw)

    def _make_transport(self, peer_timeout: float) -> Any:  # type: ignore[override]
        return self._given


def _passes(loader: ODBDataLoader, passes: int) -> list[dict[str, Any]]:
    out = []
    for epoch in range(passes):
        loader.set_epoch(epoch)
        emitted: list[int] = []
        for _ in loader:
            assert loader.step_info is not None
            emitted.extend(loader.step_info.sample_ids)
        out.append(
            {
                "carried_in": set(loader.carried_in),
                "emitted": emitted,
                "ages": dict(loader.ledger_ages),
                "ledger": set(loader.ledger),
            }
        )
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_issue_setting_every_id_within_one_pass_through_the_loader(world: int) -> None:
    lengths = long_tail(600, seed=world)
    hub = Hub(world)
    kw: dict[str, Any] = {
        "token_budget": 4096,
        "buffer_size": 64,
        "mode": "quota",
        "quota": 400,
        "shuffle": True,
        "collate_fn": lambda xs: len(xs),
        "step_meta": False,
        "prefetch_thread": False,
    }

    def rank(r: int) -> list[dict[str, Any]]:
        transport = HubTransport(hub, r) if world > 1 else LocalTransport()
        return _passes(HubLoader(transport, Lengths(lengths), **kw), 8)

    results: list[list[dict[str, Any]]] = [[] for _ in range(world)]
    threads = [
        threading.Thread(target=lambda r=r: results.__setitem__(r, rank(r))) for r in range(world)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HANG_GUARD_S)
    assert all(len(res) == 8 for res in results), "a rank failed"
    counts: Counter[int] = Counter()
    for p in range(8):
        emitted = [i for res in results for i in res[p]["emitted"]]
        ledger = results[0][p]["ledger"]
        assert len(emitted) == len(set(emitted)) and sorted([*emitted, *ledger]) == list(range(600))
        assert results[0][p]["carried_in"] <= set(emitted), f"pass {p + 1} left carried ids"
        assert max(results[0][p]["ages"].values(), default=0) <= 1
        counts.update(emitted)
    assert min(counts[i] for i in range(600)) >= 4
    shortest = sorted(range(600), key=lambda i: (lengths[i], i))[:10]
    assert statistics.mean(counts[i] for i in shortest) >= 4
