"""ODBDataLoader in one process: the DataLoader surface, bad input, step info, resume.

Multi-rank behaviour (alignment, exactly-once across ranks, peer failure) is in
test_torch_distributed.py, with real processes.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import Dataset, IterableDataset  # noqa: E402

from odb_core import (  # noqa: E402
    ConfigError,
    ODBDataLoader,
    ODBError,
    OversizeSampleError,
    SampleError,
    SampleLoadError,
    scale_loss,
)
from odb_core.protocol import StepInfo  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]


class Text(Dataset[dict[str, Any]]):
    def __init__(self, n: int, lengths: list[int] | None = None) -> None:
        self.lengths = lengths or [1 + (i * 7919) % 29 for i in range(n)]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": torch.arange(self.lengths[i]), "idx": i}


class Broken(Text):
    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == 7:
            raise KeyError("corrupt record")
        return super().__getitem__(i)


class NoCostField(Text):
    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"text": "hello"}


class Stream(IterableDataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        for i in range(self.n):
            yield {"input_ids": [0] * (1 + i % 13), "pos": i}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ids = [torch.as_tensor(s["input_ids"]) for s in samples]
    return {"input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)}


def loader(ds: Any, **kw: Any) -> ODBDataLoader:
    kw.setdefault("token_budget", 64)
    kw.setdefault("buffer_size", 8)
    kw.setdefault("collate_fn", collate)
    return ODBDataLoader(ds, **kw)


def workers(n: int) -> dict[str, Any]:
    return {"num_workers": n, "multiprocessing_context": "fork" if n else None}


def run(dl: ODBDataLoader) -> list[StepInfo]:
    infos = []
    for _ in dl:
        assert dl.step_info is not None
        infos.append(dl.step_info)
    return infos


def ids_of(infos: list[StepInfo]) -> list[int]:
    return [i for info in infos for i in info.sample_ids]


# ---- import surface ----------------------------------------------------------------


def test_import_odb_core_does_not_import_torch() -> None:
    code = (
        "import sys, odb_core, odb_core.cli, odb_core.resume; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "from odb_core import ODBDataLoader; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- bad input is rejected at construction, naming the value ----------------------------


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"batch_size": 8}, "batch_size=8"),
        ({"batch_sampler": [[0, 1]]}, "batch_sampler"),
        ({"drop_last": True}, "drop_last"),
        ({"token_budget": 0}, "token_budget=0"),
        ({"token_budget": -5}, "token_budget=-5"),
        ({"token_budget": float("nan")}, "token_budget=nan"),
        ({"mode": "sometimes"}, "'sometimes'"),
        ({"oversize": "shrug"}, "'shrug'"),
        ({"buffer_size": 0}, "buffer_size=0"),
        ({"peer_timeout": 0}, "peer_timeout=0"),
        ({"peer_timeout": float("inf")}, "peer_timeout=inf"),
        ({"shuffle": True, "sampler": [0, 1]}, "sampler"),
        ({"quota": 5}, "quota=5"),
        ({"samples_per_fetch": 0}, "samples_per_fetch=0"),
        ({"cost_model": "magic"}, "'magic'"),
    ],
)
def test_invalid_config_raises_at_construction(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        loader(Text(10), **kw)


def test_distributed_sampler_is_rejected_since_the_loader_partitions() -> None:
    ds = Text(10)
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=0)
    with pytest.raises(ConfigError, match="DistributedSampler"):
        loader(ds, sampler=sampler)


def test_iterable_dataset_rejects_shuffle() -> None:
    with pytest.raises(ConfigError, match="IterableDataset"):
        loader(Stream(5), shuffle=True)


def test_len_is_not_defined() -> None:
    with pytest.raises(TypeError, match="decided online"):
        len(loader(Text(5)))


# ---- bad samples are reported with their id ---------------------------------------------


@pytest.mark.parametrize("n", [0, 1])
def test_missing_cost_field_names_the_sample(n: int) -> None:
    dl = loader(NoCostField(5), **workers(n))
    with pytest.raises(SampleError, match=r"sample 0: no 'input_ids' field"):
        run(dl)


@pytest.mark.parametrize(
    ("cost", "needle"), [(float("nan"), "nan"), (-3, "-3"), (2.5, "2.5"), ("x", "'x'")]
)
def test_bad_cost_names_sample_and_value(cost: object, needle: str) -> None:
    dl = loader(Text(5), cost_fn=lambda s: cost if s["idx"] == 3 else 4)
    with pytest.raises(SampleError, match=rf"sample 3.*{needle}"):
        run(dl)


@pytest.mark.parametrize(("n", "thread"), [(0, True), (0, False), (2, True)])
def test_dataset_exception_surfaces_with_the_sample_id(n: int, thread: bool) -> None:
    dl = loader(Broken(20), **workers(n), prefetch_thread=thread)
    with pytest.raises(SampleLoadError, match=r"KeyError.*corrupt record.*sample 7") as info:
        run(dl)
    assert info.value.sample_id == 7


def test_oversize_error_policy_names_the_sample() -> None:
    dl = loader(Text(4, [3, 100, 3, 3]), token_budget=50)
    with pytest.raises(OversizeSampleError, match="sample 1"):
        run(dl)


def test_oversize_solo_and_truncate_policies() -> None:
    solo = run(loader(Text(4, [3, 100, 3, 3]), token_budget=50, oversize="solo"))
    assert (1,) in [info.sample_ids for info in solo]
    dl = loader(Text(4, [3, 100, 3, 3]), token_budget=50, oversize="truncate")
    seen = {}
    for batch in dl:
        info = dl.step_info
        assert info is not None
        for row, sid in enumerate(info.sample_ids):
            seen[sid] = int((batch["input_ids"][row] != 0).sum()) + 1  # arange: id 0 is a 0
        if 1 in info.sample_ids:
            assert [i for i, _ in info.truncated] == [1]
            assert batch["input_ids"].shape[1] == 50
    assert sorted(seen) == [0, 1, 2, 3]


# ---- one process: coverage, step info, helpers -----------------------------------------


@pytest.mark.parametrize(("n", "thread"), [(0, True), (0, False), (2, True), (2, False)])
def test_every_sample_once_and_step_info_matches_the_batch(n: int, thread: bool) -> None:
    dl = loader(Text(97), **workers(n), shuffle=True, prefetch_thread=thread)
    for steps, batch in enumerate(dl):
        info = dl.step_info
        assert info is not None and info.step == steps
        assert set(batch) == {"input_ids"}, "metadata leaked into the batch"
        assert batch["input_ids"].shape[0] == info.local_samples == info.global_samples
        assert info.local_tokens == info.global_tokens <= 64
        assert info.loss_scale == 1.0 and not info.is_pad
    infos = run(dl)
    assert sorted(ids_of(infos)) == list(range(97))


def test_with_step_info_yields_pairs() -> None:
    for batch, info in loader(Text(10), with_step_info=True):
        assert isinstance(info, StepInfo)
        assert batch["input_ids"].shape[0] == info.local_samples


def test_set_epoch_reshuffles_and_is_reproducible() -> None:
    def order(epoch: int) -> list[int]:
        dl = loader(Text(60), shuffle=True, seed=3)
        dl.set_epoch(epoch)
        return ids_of(run(dl))

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert sorted(order(1)) == list(range(60))


def test_iterable_dataset_with_workers_covers_each_position_once() -> None:
    dl = loader(Stream(80), num_workers=2, multiprocessing_context="fork", samples_per_fetch=3)
    assert sorted(ids_of(run(dl))) == list(range(80))


def test_id_fn_gives_stable_ids() -> None:
    dl = loader(Text(30), id_fn=lambda s: 1000 + s["idx"])
    assert sorted(ids_of(run(dl))) == list(range(1000, 1030))


def test_quota_mode_closes_early_and_reports_the_ledger() -> None:
    dl = loader(Text(100), mode="quota", quota=40)
    infos = run(dl)
    emitted = ids_of(infos)
    assert 40 <= len(emitted) < 100
    assert sorted(emitted + list(dl.ledger)) == list(range(100))


def test_quota_mode_carries_the_ledger_into_the_next_epochs() -> None:
    dl = loader(Text(100), mode="quota", quota=70, shuffle=True)
    carried: list[int] = []
    for epoch in range(4):
        dl.set_epoch(epoch)
        emitted = ids_of(run(dl))
        assert list(dl.carried_in) == carried
        assert len(emitted) == len(set(emitted))
        assert set(carried) <= set(emitted)
        assert dl._index_sampler is not None
        assert dl._index_sampler.indices[: len(carried)] == carried  # observed first
        assert dl.carried_count == len(dl.ledger) == 100 - len(emitted)
        assert sorted(emitted + list(dl.ledger)) == list(range(100))
        carried = list(dl.ledger)


def test_quota_ledger_survives_state_dict_and_an_abandoned_pass() -> None:
    dl = loader(Text(60), mode="quota", quota=40)
    first = ids_of(run(dl))
    state = json.loads(json.dumps(dl.state_dict()))
    assert sum(map(len, state["carry"])) == 60 - len(first) > 0
    again = loader(Text(60), mode="quota", quota=40)
    again.load_state_dict(state)
    again.set_epoch(1)
    it = iter(again)
    next(it)  # a pass that never closes keeps the pending carry
    again.set_epoch(1)
    assert list(again.carried_in) == list(dl.ledger)
    second = ids_of(run(again))
    assert set(dl.ledger) <= set(second) and len(second) == len(set(second))


@pytest.mark.parametrize("kw", [{"id_fn": lambda s: s["idx"]}, {}])
def test_quota_mode_needs_index_ids(kw: dict[str, Any]) -> None:
    ds: Any = Text(10) if kw else Stream(10)
    with pytest.raises(ConfigError, match="mode='quota'"):
        loader(ds, mode="quota", quota=5, **kw)


def test_scale_loss_applies_the_step_scale_and_pads_to_zero() -> None:
    info = run(loader(Text(10)))[0]
    loss = torch.tensor(2.0, requires_grad=True)
    assert scale_loss(loss, info).item() == pytest.approx(2.0 * info.loss_scale)
    pad = StepInfo(0, 0, 0, True, None, 0, 5, 0, 50, 0.0)
    scaled = scale_loss(loss, pad)
    scaled.backward()
    assert scaled.item() == 0.0 and loss.grad is not None and loss.grad.item() == 0.0


@pytest.mark.parametrize("thread", [True, False])
def test_breaking_early_then_iterating_again_starts_a_fresh_epoch(thread: bool) -> None:
    dl = loader(Text(50), prefetch_thread=thread)
    it = iter(dl)
    next(it)
    next(it)
    assert sorted(ids_of(run(dl))) == list(range(50))


def test_a_superseded_iterator_refuses_to_continue() -> None:
    dl = loader(Text(50))
    first = iter(dl)
    next(first)
    iter(dl)
    with pytest.raises(ODBError, match="superseded"):
        next(first)


# ---- resumable state ------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_resume_at_a_random_step_keeps_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    kw: dict[str, Any] = {"shuffle": True, **workers(rng.choice([0, 1]))}
    kw["prefetch_thread"] = rng.choice([True, False])
    dl = loader(Text(70), **kw)
    dl.set_epoch(2)
    before = []
    stop = rng.randrange(1, 12)
    for i, _ in enumerate(dl):
        assert dl.step_info is not None
        before.extend(dl.step_info.sample_ids)
        if i + 1 == stop:
            break
    state = dl.state_dict()
    assert json.loads(json.dumps(state)) == state, "state must be plain data"
    fresh = loader(Text(70), **kw)
    fresh.load_state_dict(state)
    assert fresh.epoch == 2
    fresh.set_epoch(2)
    after = run(fresh)
    assert after[0].step == stop
    assert sorted(before + ids_of(after)) == list(range(70))


def test_state_from_another_config_or_dataset_is_rejected() -> None:
    dl = loader(Text(20))
    run(dl)
    state = dl.state_dict()
    with pytest.raises(ConfigError, match=r"protocol.budget_tokens: saved=64 now=128"):
        loader(Text(20), token_budget=128).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"length: saved=20 now=21"):
        loader(Text(21)).load_state_dict(state)
    with pytest.raises(ConfigError, match="not an ODBDataLoader state"):
        loader(Text(20)).load_state_dict({"step": 3})


def test_state_of_a_finished_epoch_resumes_to_an_empty_epoch() -> None:
    dl = loader(Text(20))
    run(dl)
    fresh = loader(Text(20))
    fresh.load_state_dict(dl.state_dict())
    assert run(fresh) == []
    fresh.set_epoch(1)
    assert sorted(ids_of(run(fresh))) == list(range(20))


def test_loss_scale_sums_to_world_on_real_steps() -> None:
    # World size 1: local == global, so the scale is exactly 1 (tokens and samples).
    for norm in ("tokens", "samples"):
        infos = run(loader(Text(30), loss_normalization=norm))
        assert all(math.isclose(i.loss_scale, 1.0) for i in infos)
