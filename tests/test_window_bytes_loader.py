"""The window's byte bound in the torch loader (`window_bytes=`), on two real gloo
ranks with DataLoader workers and image-sized samples (1 MiB of `pixel_values`
each): what a rank holds between a sample's arrival and its collation stays within
the bound plus the one fetch that crossed it, every sample is emitted exactly once,
the ranks run the same steps, and the recorded trace is a behaviour of the model.
Without the bound (`window_bytes=0`, the broken variant) the same check fails.

And the shared-memory error: a worker killed by SIGBUS (what an exhausted /dev/shm
does to it) surfaces as the loader's `SharedMemoryError`, naming the rank, the
bytes it held and the settings to change.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from guards import HANG_GUARD_S

torch = pytest.importorskip("torch")

import gloo_ranks  # noqa: E402
from test_tlc import require_tlc  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.errors import ConfigError  # noqa: E402
from odb_core.torch.held import (  # noqa: E402
    HeldBytes,
    SharedMemoryError,
    note_worker_exits,
    shared_memory_error,
    tensor_bytes,
)
from odb_core.torch.options import DEFAULT_WINDOW_BYTES, LoaderOptions  # noqa: E402
from odb_core.verify.tlc import validate_trace_tlc  # noqa: E402
from odb_core.verify.trace_validation import ProtocolTrace, validate_trace  # noqa: E402

pytestmark = pytest.mark.torch

N = 48
PIXELS = (256, 1024)  # float32: 1 MiB a sample
FETCH = 2
BOUND = 6 << 20


class Images(Dataset[dict[str, Any]]):
    def __init__(self, n: int, bus_at: int | None = None, sig: int = signal.SIGBUS) -> None:
        self.n, self.bus_at, self.sig = n, bus_at, sig

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.bus_at and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), self.sig)  # SIGBUS: what a full /dev/shm does to a worker
        return {
            "input_ids": torch.full((8 + (i * 7919) % 33,), i, dtype=torch.int64),
            "pixel_values": torch.zeros(PIXELS),
        }


def ids_of(samples: list[dict[str, Any]]) -> list[int]:
    return [int(s["input_ids"][0]) for s in samples]


def run_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    loader = ODBDataLoader(
        Images(N),
        token_budget=96,
        cost_model="padded",
        max_steps_per_round=2,
        window_bytes=spec["window_bytes"],
        collate_fn=ids_of,
        step_meta=False,
        num_workers=2,
        multiprocessing_context="fork",
        samples_per_fetch=FETCH,
        trace_dir=spec["trace_dir"],
    )
    steps, ids = [], []
    for batch in loader:
        info = loader.step_info
        assert info is not None
        steps.append(info.step)
        ids.extend([] if info.is_pad else batch)
    stats = loader.epoch_stats
    assert stats is not None
    loader.close()
    return {"steps": steps, "ids": ids, "stats": stats._asdict()}


def launch(spec: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    results = gloo_ranks.launch(f"{__name__}:run_rank", 2, spec, out, HANG_GUARD_S)
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} wrote no result"
        assert res["ok"], f"rank {r} failed: {res['error']}"
    return [r for r in results if r is not None]


def sample_bytes() -> int:
    return tensor_bytes(Images(N)[N - 1])


def assert_within_bound(results: list[dict[str, Any]], bound: int) -> None:
    for r, res in enumerate(results):
        peak = res["stats"]["window_bytes_peak"]
        assert peak <= bound + FETCH * sample_bytes(), (
            f"rank {r} held {peak:,} bytes, bound {bound:,} plus one fetch"
        )


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("bounded")
    results = launch({"window_bytes": BOUND, "trace_dir": str(out / "trace")}, out)
    return results, out / "trace"


def test_two_gloo_ranks_keep_the_window_under_its_byte_bound(
    bounded: tuple[list[dict[str, Any]], Path], tmp_path: Path
) -> None:
    results, traces = bounded
    a, b = results
    assert a["steps"] == b["steps"] == list(range(len(a["steps"])))
    ids = a["ids"] + b["ids"]
    assert len(ids) == len(set(ids)) and sorted(ids) == list(range(N))
    assert_within_bound(results, BOUND)
    for res in results:
        s = res["stats"]
        assert s["window_bytes_bound"] == BOUND
        assert s["window_bytes_peak"] >= BOUND // 2  # the bound was met, not idle
        assert 0 < s["window_samples_mean"] <= s["window_samples_peak"]
    trace = ProtocolTrace.merge(sorted(traces.glob("*.json")))
    assert trace.protocol["window_bytes"] == BOUND
    assert all(any(e["action"] == "FormEarly" for e in rt.events) for rt in trace.ranks)
    report = validate_trace(trace)
    assert report.ok, report.reason

    # The broken variant, the bound ignored: every rank holds its whole share.
    broken = launch({"window_bytes": 0, "trace_dir": None}, tmp_path / "unbounded")
    assert all(r["stats"]["window_bytes_bound"] is None for r in broken)
    with pytest.raises(AssertionError, match="plus one fetch"):
        assert_within_bound(broken, BOUND)


@pytest.mark.tlc
def test_the_byte_bounded_trace_passes_the_tlc_trace_check(
    bounded: tuple[list[dict[str, Any]], Path],
) -> None:
    require_tlc()
    report = validate_trace_tlc(ProtocolTrace.merge(sorted(bounded[1].glob("*.json"))))
    assert report.ok, report.reason


def test_a_worker_out_of_shared_memory_names_the_loader_its_bytes_and_the_setting() -> None:
    loader = ODBDataLoader(
        Images(16, bus_at=9),
        token_budget=96,
        cost_model="padded",
        collate_fn=ids_of,
        step_meta=False,
        num_workers=1,
        multiprocessing_context="fork",
        samples_per_fetch=FETCH,
        sharding="static",  # the default bound applies under static sharding
    )
    with pytest.raises(SharedMemoryError) as info:
        for _ in loader:
            pass
    loader.close()
    text = str(info.value)
    assert "ODBDataLoader rank 0" in text and "shared memory" in text
    assert f"window_bytes={DEFAULT_WINDOW_BYTES:,}" in text and "bytes (" in text
    assert "Lower window_bytes=" in text and "samples_per_fetch= (2)" in text
    assert isinstance(info.value, RuntimeError)  # what torch raised is still caught alike


def test_the_shared_memory_error_is_only_for_shared_memory() -> None:
    held = HeldBytes(100)
    held.arrive(40)
    held.name(7, 40)
    full = RuntimeError("unable to write to file </torch_91_1234_0>: No space left on device (28)")
    err = shared_memory_error(full, rank=1, held=held, samples_per_fetch=8)
    assert (
        err is not None and "rank 1" in str(err) and "1 preprocessed samples, 40 bytes" in str(err)
    )
    other = RuntimeError("CUDA error: device-side assert triggered")
    assert shared_memory_error(other, rank=1, held=held, samples_per_fetch=8) is None
    assert shared_memory_error(ValueError("shm"), rank=1, held=held, samples_per_fetch=8) is None


@pytest.mark.parametrize(("sig", "shm"), [(signal.SIGBUS, True), (signal.SIGKILL, False)])
def test_a_worker_that_exited_unexpectedly_is_named_by_the_signal_that_killed_it(
    sig: int, shm: bool
) -> None:
    """torch raises "exited unexpectedly", naming no signal, when its data-queue read
    sees the dead worker's connection reset before its SIGCHLD handler runs (a race
    that load decides); the workers' exit codes still say SIGBUS."""
    inner = iter(
        torch.utils.data.DataLoader(
            Images(4, bus_at=0, sig=sig),
            batch_size=None,
            num_workers=1,
            multiprocessing_context="fork",
        )
    )
    with pytest.raises(RuntimeError):
        next(inner)  # whichever of torch's two messages won the race
    worker = inner._workers[0]  # type: ignore[attr-defined]
    worker.join(HANG_GUARD_S)
    assert worker.exitcode == -sig
    raced = RuntimeError(f"DataLoader worker (pid(s) {worker.pid}) exited unexpectedly")
    note_worker_exits(raced, inner)
    assert raced.__notes__ == [
        f"DataLoader worker exit signals: {signal.Signals(sig).name} "
        f"({signal.strsignal(sig).lower()})"
    ]
    held = HeldBytes(None)
    err = shared_memory_error(raced, rank=0, held=held, samples_per_fetch=2)
    assert (err is not None) is shm
    other = RuntimeError("CUDA error: device-side assert triggered")
    note_worker_exits(other, inner)  # only torch's "exited unexpectedly" is noted
    assert not hasattr(other, "__notes__")
    del inner


def test_tensor_bytes_counts_nested_tensors_and_arrays() -> None:
    np = pytest.importorskip("numpy")
    sample = {"a": torch.zeros(3, dtype=torch.float64), "b": [np.zeros(4, dtype=np.int32), "x"]}
    assert tensor_bytes(sample) == 24 + 16


@pytest.mark.parametrize(
    ("kw", "bound"),
    [
        ({"sharding": "static"}, DEFAULT_WINDOW_BYTES),
        ({"partition": False}, DEFAULT_WINDOW_BYTES),  # static by default there
        ({}, None),  # dynamic by default: no byte bound (join mode and static only)
        ({"window_bytes": 0}, None),
        ({"window_bytes": 123}, 123),  # a bound given: static by default
        ({"mode": "quota"}, None),
        ({"sharding": "dynamic"}, None),
    ],
)
def test_the_default_bound_applies_where_the_core_bounds_bytes(
    kw: dict[str, Any], bound: int | None
) -> None:
    opts = LoaderOptions.of(token_budget=8, **kw)
    assert opts.window_bound(opts.sharding(iterable=False).sharding) == bound


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"window_bytes": -1}, r"window_bytes=-1 must be a non-negative integer"),
        ({"window_bytes": 1.5}, r"window_bytes=1.5 must be"),
        ({"window_bytes": 10, "mode": "quota"}, r"window_bytes=10 needs mode='join'"),
        ({"window_bytes": 10, "sharding": "dynamic"}, r"window_bytes=10 needs .*'dynamic'"),
    ],
)
def test_bad_window_bytes_fail_before_the_loader_meets_its_peers(
    kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        LoaderOptions.of(token_budget=8, **kw)
