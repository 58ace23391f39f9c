"""The learned cost table in the loader: exchanged once at a dynamic epoch's close
(in-process ranks, and 2 real gloo ranks: an all-reduce MAX of one byte per id),
pricing the next epoch, carried by the state, validated when loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import gloo_ranks  # noqa: E402
from test_torch_dynamic import Skewed, collate, length_of  # noqa: E402
from thread_ranks import RankLoader, on_ranks  # noqa: E402

from odb_core.cost_table import CostTable, decode, encode  # noqa: E402
from odb_core.errors import ResumeStateError  # noqa: E402
from odb_core.step import StepInfo  # noqa: E402
from odb_core.torch.transport import LocalTransport  # noqa: E402

pytestmark = pytest.mark.torch

N = 160
KW: dict[str, Any] = {"collate_fn": collate, "token_budget": 64, "buffer_size": 8,
                      "max_steps_per_round": 4}  # fmt: skip


def _epoch(loader: Any) -> list[StepInfo]:
    infos = []
    for _ in loader:
        assert loader.step_info is not None
        infos.append(loader.step_info)
    return infos


def _expected(i: int) -> int:
    return decode(encode(length_of(i)))


def test_a_closed_epoch_teaches_every_rank_the_same_table_and_the_state_carries_it() -> None:
    def body(loader: Any) -> tuple[list[StepInfo], dict[str, Any]]:
        assert loader.describe()["sharding"] == "dynamic"  # the default here
        first = _epoch(loader)
        assert loader.cost_table is not None
        second = _epoch(loader)
        return first + second, loader.state_dict()

    results = on_ranks(2, lambda t: RankLoader(t, Skewed(), **KW), body)
    tables = [res.loader.cost_table for res in results]
    assert tables[0] == tables[1] and tables[0] is not None
    assert [tables[0].price(i) for i in range(N)] == [_expected(i) for i in range(N)]
    ids = [i for res in results for i in res.ids]
    assert sorted(ids) == sorted(list(range(N)) * 2)  # each epoch exactly once
    states = [json.loads(json.dumps(res.state)) for res in results]
    assert all("cost_table" in s for s in states)

    def resume(loader: Any) -> tuple[list[StepInfo], dict[str, Any]]:
        loader.load_state_dict(states)
        assert loader.cost_table == tables[0]
        return _epoch(loader), {}

    again = on_ranks(2, lambda t: RankLoader(t, Skewed(), **KW), resume)
    assert sorted(i for res in again for i in res.ids) == list(range(N))

    # Optional: without the table the same states resume priced at the mean.
    bare = [{k: v for k, v in s.items() if k != "cost_table"} for s in states]
    fresh = RankLoader(LocalTransport(), Skewed(), **KW)
    fresh.load_state_dict(bare)
    assert fresh.cost_table is None and "cost_table" not in fresh.state_dict()
    assert sorted(i for info in _epoch(fresh) for i in info.sample_ids) == list(range(N))
    assert fresh.cost_table is not None and fresh.cost_table.seen == N  # learned again
    # Untrusted: a table that does not match its checksum, or the dataset, is refused.
    for bad, match in (
        ({**states[0]["cost_table"], "crc32": 1}, "crc32"),
        ({**states[0]["cost_table"], "ids": N + 1}, "dataset has 160 ids"),
    ):
        tampered = [{**s, "cost_table": bad} for s in states]
        with pytest.raises(ResumeStateError, match=match):
            RankLoader(LocalTransport(), Skewed(), **KW).load_state_dict(tampered)
    odd = [states[0], {**states[1], "cost_table": CostTable(bytes(N)).to_state()}]
    with pytest.raises(ResumeStateError, match="differs between the ranks"):
        RankLoader(LocalTransport(), Skewed(), **KW).load_state_dict(odd)


def run_exchange(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """On a real gloo rank: the loader transport's all-reduce of this rank's table."""
    from odb_core.cost_table import record
    from odb_core.torch.transport import GlooTransport

    t = GlooTransport(30.0)
    t.connect({})
    size = spec["size"]
    mine = record({i: length_of(i) for i in range(rank, size, world)}, size)
    codes = t.reduce_max(bytes(mine), "a test exchange")
    return {"codes": list(codes)}


def test_the_table_exchange_is_an_all_reduce_max_on_real_gloo_ranks(tmp_path: Path) -> None:
    results = gloo_ranks.launch(f"{__name__}:run_exchange", 2, {"size": 50}, tmp_path)
    for r, res in enumerate(results):
        assert res is not None and res["ok"], f"rank {r}: {res}"
    tables = [CostTable(bytes(res["codes"])) for res in results if res is not None]
    assert tables[0] == tables[1]
    assert [tables[0].price(i) for i in range(50)] == [_expected(i) for i in range(50)]
