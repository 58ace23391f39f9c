"""ODBDataLoader benchmarks (issue 5). Run with `make bench`.

Targets: ODBDataLoader samples/s >= 0.95 x DataLoader(batch_size=8) on the same
dataset and workers with a trivially cheap model; <= 1 collective per round;
collectives <= 2% of training time in a 2-rank gloo run.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader  # noqa: E402

from odb_core.bench.loader_bench import SyntheticText, pad_collate  # noqa: E402
from odb_core.cli.bench import bench  # noqa: E402
from odb_core.torch import ODBDataLoader  # noqa: E402
from odb_core.torch.wire import pack, unpack  # noqa: E402

N = 3000


def _epoch(loader: Any, odb: bool) -> float:
    start = time.perf_counter()
    n = 0
    for batch in loader:
        n += loader.step_info.local_samples if odb else batch["input_ids"].shape[0]
    return n / (time.perf_counter() - start)


@pytest.mark.parametrize("workers", [0, 1])
def test_one_process_loader_throughput(benchmark: BenchmarkFixture, workers: int) -> None:
    """Loader alone (no model, no peers): samples/s of ODB vs plain, same workers."""
    ds = SyntheticText(N, 64, work_us=20)
    kw: dict[str, Any] = {"num_workers": workers, "collate_fn": pad_collate}
    if workers:
        kw.update(persistent_workers=True, multiprocessing_context="fork")
    plain = DataLoader(ds, batch_size=8, shuffle=True, **kw)
    odb = ODBDataLoader(ds, token_budget=8 * 64, shuffle=True, **kw)
    _epoch(plain, False), _epoch(odb, True)  # warm the workers up
    plain_rates = [_epoch(plain, False) for _ in range(3)]
    odb_rates = benchmark.pedantic(lambda: _epoch(odb, True), rounds=3, iterations=1)
    del odb_rates
    assert benchmark.stats is not None
    odb_rates = [N / s for s in benchmark.stats.stats.data]
    ratio = sorted(odb_rates)[1] / sorted(plain_rates)[1]
    benchmark.extra_info.update(
        odb_samples_per_s=round(sorted(odb_rates)[1]),
        plain_samples_per_s=round(sorted(plain_rates)[1]),
        ratio=round(ratio, 3),
    )


def test_two_rank_gloo_training(benchmark: BenchmarkFixture) -> None:
    """`odb bench`: 2 gloo ranks, 1 worker each, cheap DDP model; medians of 3 epochs."""
    result = benchmark.pedantic(
        lambda: bench(ranks=2, workers=1, samples=2000, repeats=3), rounds=1, iterations=1
    )
    odb = result["odb"]
    benchmark.extra_info.update(
        ratio=round(result["ratio"], 3),
        odb_samples_per_s=round(odb["samples_per_s"]),
        plain_samples_per_s=round(result["plain"]["samples_per_s"]),
        collective_pct=round(odb["collective_pct"], 3),
        collectives_per_round=odb["collectives_per_round"],
    )
    assert result["ok"]
    assert odb["collectives_per_round"] <= 1.0


def test_wire_pack_unpack_chunk_of_eight(benchmark: BenchmarkFixture) -> None:
    records = [
        (i, {"input_ids": torch.arange(64 + i), "labels": torch.arange(64 + i)}) for i in range(8)
    ]
    benchmark(lambda: unpack(pack(records)))
