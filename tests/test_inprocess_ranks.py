"""Two ranks of ODBDataLoader in one process (tests/thread_ranks.py): pads, global
counts and the progress a state records, in seconds rather than spawned processes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_tlc import require_tlc  # noqa: E402
from thread_ranks import RankLoader, on_ranks, to_the_end, until  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from odb_core import ODBDataLoader, read_step_meta, scaled_loss  # noqa: E402
from odb_core.step import StepInfo  # noqa: E402
from odb_core.torch.pipeline import EpochPipeline  # noqa: E402
from odb_core.verify.tlc.trace_check import validate_trace_tlc  # noqa: E402
from odb_core.verify.trace_validation import ProtocolTrace, validate_trace  # noqa: E402

pytestmark = pytest.mark.torch


class Chat(Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = torch.full((2 + (i * 7919) % 19,), i, dtype=torch.int64)
        labels = ids.clone()
        labels[: len(ids) // 3] = -100
        return {"input_ids": ids, "labels": labels}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    pad = torch.nn.utils.rnn.pad_sequence
    return {
        "input_ids": pad([s["input_ids"] for s in samples], batch_first=True),
        "labels": pad([s["labels"] for s in samples], batch_first=True, padding_value=-100),
    }


# Rank 1 has far fewer samples than rank 0, so it pads while rank 0 still trains.
SHARDS = [list(range(0, 24)), [24, 25, 26]]


def make(**kw: Any) -> Any:
    def build(transport: Any) -> ODBDataLoader:
        return RankLoader(
            transport,
            Chat(27),
            token_budget=48,
            buffer_size=4,
            max_steps_per_round=2,
            collate_fn=collate,
            sampler=SHARDS[transport.rank],
            partition=False,
            **kw,
        )

    return build


def with_batches(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
    infos = []
    for batch in loader:
        info = loader.step_info
        assert info is not None
        meta = read_step_meta(batch)
        loss = torch.tensor(2.5, requires_grad=True)
        scaled_loss(batch, loss).backward()
        assert loss.grad is not None
        infos.append(info)
        info.__dict__["_test"] = (meta.loss_scale, float(loss.grad))
    return infos, loader.state_dict()


@pytest.mark.parametrize("kw", [{}, {"grad_accum_steps": 2}, {"prefetch_thread": False}])
def test_pad_steps_have_loss_scale_zero_and_real_windows_sum_to_the_world(
    kw: dict[str, Any],
) -> None:
    ranks = on_ranks(2, make(**kw), with_batches)
    a, b = (r.infos for r in ranks)
    assert len(a) == len(b)
    pads = [info for r in ranks for info in r.infos if info.is_pad]
    assert pads, "rank 1 runs dry first and pads"
    for info in pads:
        assert info.loss_scale == 0.0 and info.local_samples == 0
        assert info.local_tokens == info.local_loss_tokens == 0 and info.batch is None
        assert info.__dict__["_test"] == (0.0, 0.0)
    windows: dict[int, float] = {}
    for r in ranks:
        for info in r.infos:
            meta_scale, grad = info.__dict__["_test"]
            assert meta_scale == info.loss_scale == pytest.approx(grad)
            windows[info.window] = windows.get(info.window, 0.0) + info.loss_scale
    assert all(total == pytest.approx(2.0) for total in windows.values())
    for x, y in zip(a, b, strict=True):
        assert x.global_samples == y.global_samples == x.local_samples + y.local_samples
        assert x.global_loss_tokens == x.local_loss_tokens + y.local_loss_tokens


def test_a_state_records_the_global_samples_emitted() -> None:
    ranks = on_ranks(2, make(), until(3))
    emitted = sum(info.global_samples for info in ranks[0].infos)
    assert emitted > sum(info.local_samples for info in ranks[0].infos)
    for r in ranks:
        assert r.state["step"] == 3 and r.state["emitted"] == emitted
    whole = on_ranks(2, make(), to_the_end)
    assert whole[0].state["emitted"] == 27 and whole[0].state["closed"]


# ---- recorded traces of real runs: plan, global counts, loss scales --------------------


def traced(tmp_path: Path, **kw: Any) -> ProtocolTrace:
    on_ranks(2, make(trace_dir=tmp_path, grad_accum_steps=2, **kw), to_the_end)
    return ProtocolTrace.merge(sorted(tmp_path.glob("trace-*.json")))


def test_a_real_trace_carries_the_plan_and_the_scales_the_loop_received(tmp_path: Path) -> None:
    trace = traced(tmp_path)
    assert [sorted(rt.plan or ()) for rt in trace.ranks] == SHARDS
    assert all(rt.scales for rt in trace.ranks)
    report = validate_trace(trace)
    assert report.ok, report.reason
    bad = copy.deepcopy(trace)
    assert bad.ranks[1].scales is not None
    pad = next(
        k
        for k, ids in enumerate(
            s for e in bad.ranks[1].events if e["action"] == "Receive" for s in e["steps"]
        )
        if ids is None
    )
    bad.ranks[1].scales[pad] = 1.0  # a pad step trained with a loss scale of 1
    report = validate_trace(bad)
    assert not report.ok and "loss scale 1.0" in report.reason


def dropping_sample_5(monkeypatch: pytest.MonkeyPatch) -> None:
    pull = EpochPipeline._pull

    def dropping(self: EpochPipeline) -> Any:
        sample = pull(self)
        return pull(self) if sample is not None and sample.id == 5 else sample

    monkeypatch.setattr(EpochPipeline, "_pull", dropping)


def test_a_real_run_that_dropped_a_sample_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dropping_sample_5(monkeypatch)
    trace = traced(tmp_path)
    report = validate_trace(trace)
    assert not report.ok and "never observed ids [5]" in report.reason


@pytest.mark.tlc
def test_a_real_run_that_dropped_a_sample_is_rejected_by_tlc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_tlc()
    dropping_sample_5(monkeypatch)
    report = validate_trace_tlc(traced(tmp_path))
    assert not report.ok and "not a step of DGAP" in report.reason


@pytest.mark.tlc
def test_real_traces_under_tlc(tmp_path: Path) -> None:
    require_tlc()
    trace = traced(tmp_path)
    assert validate_trace_tlc(trace).ok
    bad = copy.deepcopy(trace)
    assert bad.ranks[0].scales
    bad.ranks[0].scales[0] += 0.5
    report = validate_trace_tlc(bad)
    assert not report.ok and "loss scale" in report.reason
