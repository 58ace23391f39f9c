"""Early forms in the torch loader (issue 24): `ODBDataLoader(early_form=K0,
early_form_wait=S)`. The options are checked up front; the torch layer only
observes (is the next sample there? how long would the rest of the window take?)
and the core decides (`RankAction.FORM_EARLY in machine.enabled()`).

Runs here are in-process (tests/thread_ranks.py: two ranks as threads, the source
read on the look-ahead thread, no worker processes). To make the runs that must
take early forms independent of timing, the observation is forced: every time the
core enables FORM_EARLY, the loop takes it (`force_early`). test_torch_early.py
runs the same on two real gloo ranks with DataLoader workers.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_tlc import require_tlc  # noqa: E402
from thread_ranks import RankLoader, on_ranks, to_the_end, until  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.batch import Batch  # noqa: E402
from odb_core.config import ProtocolConfig  # noqa: E402
from odb_core.cost import Budget, PaddedTokens  # noqa: E402
from odb_core.errors import ConfigError, ODBError, ResumeStateError  # noqa: E402
from odb_core.protocol import RankAction, RankMachine  # noqa: E402
from odb_core.sample import Sample  # noqa: E402
from odb_core.step import StepInfo  # noqa: E402
from odb_core.torch import rounds  # noqa: E402
from odb_core.torch.lookahead import LookAhead, early_form_decision  # noqa: E402
from odb_core.torch.options import LoaderOptions  # noqa: E402
from odb_core.verify.tlc.trace_check import validate_trace_tlc  # noqa: E402
from odb_core.verify.trace_validation import ProtocolTrace, validate_trace  # noqa: E402

pytestmark = pytest.mark.torch

N = 60


class Lengths(Dataset[dict[str, Any]]):
    """Samples of spread lengths; `delay` seconds each (a slow preprocessing)."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.delay:
            time.sleep(self.delay)
        return {"input_ids": torch.full((1 + (i * 7919) % 23,), i, dtype=torch.int64)}


def ids_of(samples: list[dict[str, Any]]) -> list[int]:
    return [int(s["input_ids"][0]) for s in samples]


def make(n: int = N, delay: float = 0.0, **kw: Any) -> Any:
    options: dict[str, Any] = {
        "token_budget": 48,
        "cost_model": "padded",
        "buffer_size": 12,
        "max_steps_per_round": 2,
        "early_form": 3,
        "early_form_wait": 0.0,
        "collate_fn": ids_of,
        "step_meta": False,
        **kw,
    }

    def build(transport: Any) -> ODBDataLoader:
        return RankLoader(transport, Lengths(n, delay), **options)

    return build


@pytest.fixture
def force_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop takes FORM_EARLY every time the core enables it (no timing)."""
    monkeypatch.setattr(rounds, "early_form_decision", lambda *a: True)


def form_early_count(trace: ProtocolTrace) -> list[int]:
    return [sum(e["action"] == "FormEarly" for e in rt.events) for rt in trace.ranks]


def assert_exactly_once(ids: list[int], n: int) -> None:
    assert len(ids) == len(set(ids)), "a sample id was emitted twice"
    missing = sorted(set(range(n)) - set(ids))
    assert not missing, f"missing {missing[:10]}"
    assert set(ids) <= set(range(n))


def emitted(infos: list[StepInfo]) -> list[int]:
    return [i for info in infos for i in info.sample_ids]


_FORM_EARLY = RankMachine.form_early


def form_early_dropping_the_rest(self: RankMachine) -> list[Batch]:
    """Broken on purpose: an early form discards what it holds back."""
    batches = _FORM_EARLY(self)
    if batches:
        self.buffer = {}
    return batches


# ---- options -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"early_form": 0}, r"early_form=0 must be >= 1"),
        ({"early_form": True}, r"early_form=True must be >= 1"),
        ({"early_form": "8"}, r"early_form='8' must be >= 1"),
        ({"early_form": 8, "early_form_wait": -1}, r"early_form_wait=-1 must be"),
        ({"early_form": 8, "early_form_wait": float("nan")}, r"early_form_wait=nan must be"),
        ({"early_form": 8, "early_form_wait": "1s"}, r"early_form_wait='1s' must be"),
        ({"early_form": 8, "mode": "quota"}, r"early_form=8 needs mode='join'.*'quota'"),
        ({"early_form": 8, "sharding": "dynamic"}, r"early_form=8 needs .*'dynamic'"),
        ({"early_form": 8, "deterministic": True}, r"early_form=8 .*deterministic=True"),
        ({"early_form": 8, "prefetch_thread": False}, r"early_form=8 .*prefetch_thread=False"),
        ({"early_form": 64}, r"early_form=64 must be below buffer_size=64"),
        ({"early_form": 1024, "cost_model": "padded"}, r"early_form=1024 .* buffer_size=1024"),
        ({"early_form": 16, "buffer_size": 16}, r"early_form=16 must be below buffer_size=16"),
    ],
)
def test_bad_early_form_options_fail_clearly_before_the_loader_meets_its_peers(
    kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        LoaderOptions.of(token_budget=64, **kw)
    with pytest.raises(ConfigError, match=message):
        ODBDataLoader(Lengths(4), token_budget=64, **kw)


def test_good_early_form_options_reach_the_core() -> None:
    loader = ODBDataLoader(Lengths(4), token_budget=64, early_form=8, early_form_wait=0)
    assert loader.options.batch.early_form == 8 and loader.config.early_form == 8
    assert loader.config.describe()["early_form"] == 8  # part of a state's fingerprint
    off = ODBDataLoader(Lengths(4), token_budget=64)
    assert off.config.early_form is None and "early_form" not in off.config.describe()


# ---- the driver: the core decides, the torch layer observes ------------------------


def _machine(early_form: int | None) -> RankMachine:
    p = ProtocolConfig(
        world_size=1,
        budget=Budget(4),
        cost_model=PaddedTokens(),
        buffer_size=8,
        early_form=early_form,
    )
    return RankMachine(0, p)


def test_fill_forms_early_only_when_the_core_enables_it_and_the_driver_says_so() -> None:
    samples = iter([Sample(0, 2), Sample(1, 2), Sample(2, 1), Sample(3, 1)])
    asked: list[int] = []

    def early(m: RankMachine) -> Any:
        def look() -> bool:
            assert RankAction.FORM_EARLY in m.enabled()  # asked only when enabled
            asked.append(len(m.buffer))
            return True

        return look

    m = _machine(3)
    c = m.fill(lambda: next(samples), early(m))
    assert asked == [3]  # not before the window held early_form samples
    assert c.offered == 1 and [s.id for s in m.ready[0].samples] == [0, 1]
    # The same observation with early forms off in the core: never asked, never formed.
    plain = _machine(None)
    samples = iter([Sample(0, 2), Sample(1, 2), Sample(2, 1), Sample(3, 1)])
    asked.clear()
    plain.fill(lambda: next(samples, None), early(plain))
    assert asked == [] and sorted(s.id for b in plain.ready for s in b.samples) == [0, 1, 2, 3]
    # The driver saying no: the rank keeps pulling.
    m2 = _machine(3)
    samples = iter([Sample(0, 2), Sample(1, 2), Sample(2, 1), Sample(3, 1)])
    m2.fill(lambda: next(samples, None), lambda: False)
    assert sorted(s.id for b in m2.ready for s in b.samples) == [0, 1, 2, 3]


class _Look:
    def __init__(self, ready: bool, per_sample: float) -> None:
        self._ready, self.per_sample = ready, per_sample

    def ready(self) -> bool:
        return self._ready

    def wait_s(self, samples: int) -> float:
        return samples * self.per_sample


@pytest.mark.parametrize(
    ("ready", "pending", "missing", "per_sample", "wait", "queued", "early"),
    [
        (False, 0, 10, 0.1, 0.25, 0, True),  # 1 s to fill > 0.25 s, the loop starves
        (False, 0, 10, 0.1, 0.25, 1, False),  # the loop still has a step to train on
        (False, 0, 2, 0.1, 0.25, 0, False),  # 0.2 s: wait for them
        (True, 0, 10, 0.1, 0.25, 0, False),  # the next sample is there
        (False, 3, 10, 0.1, 0.25, 0, False),  # records already fetched
        (False, 0, 0, 0.1, 0.0, 0, False),  # nothing left to wait for
    ],
)
def test_the_observation_behind_an_early_form(
    ready: bool,
    pending: int,
    missing: int,
    per_sample: float,
    wait: float,
    queued: int,
    early: bool,
) -> None:
    look: Any = _Look(ready, per_sample)
    assert early_form_decision(look, pending, missing, wait, queued) is early


def test_lookahead_reads_ahead_measures_and_says_when_a_chunk_is_there() -> None:
    gate = threading.Event()

    def chunks() -> Iterator[list[Any]]:
        yield [(0, "a"), (1, "b")]
        gate.wait()
        yield [(2, "c")]

    look = LookAhead(chunks())
    assert look.wait_s(0) == 0.0
    assert next(look) == [(0, "a"), (1, "b")]
    assert look.samples == 2 and look.wait_s(4) == pytest.approx(2 * look.busy_s)
    assert not look.ready()  # the reader waits on the gate: nothing queued
    gate.set()
    assert next(look) == [(2, "c")]
    with pytest.raises(StopIteration):
        next(look)
    assert look.ready()  # the end counts as there
    assert look.wait_s(1) >= 0.0 and not _wait_dead(look)


def _wait_dead(look: LookAhead) -> bool:
    look.close(timeout=60)
    return look.alive


def test_lookahead_passes_on_the_sources_error_and_closes_a_blocked_reader() -> None:
    def failing() -> Iterator[list[Any]]:
        yield [(0, "a")]
        raise ValueError("bad sample 1")

    look = LookAhead(failing())
    assert next(look) == [(0, "a")]
    with pytest.raises(ValueError, match="bad sample 1"):
        next(look)
    assert math_inf(LookAhead(iter([])).wait_s(3))

    endless = LookAhead(iter(lambda: [(0, "x")], None), depth=1)  # fills its queue, blocks
    while not endless.ready():
        time.sleep(0.01)
    assert not _wait_dead(endless)
    with pytest.raises(ODBError, match="closed mid-epoch"):  # never taken for the end
        next(endless)


def math_inf(x: float) -> bool:
    return x == float("inf")


# ---- two in-process ranks ------------------------------------------------------


@pytest.mark.usefixtures("force_early")
def test_forced_early_forms_keep_exactly_once_and_equal_steps(tmp_path: Path) -> None:
    ranks = on_ranks(2, make(trace_dir=tmp_path), to_the_end)
    a, b = (r.infos for r in ranks)
    assert len(a) == len(b) and [x.step for x in a] == [y.step for y in b]
    assert_exactly_once(emitted(a) + emitted(b), N)
    for x, y in zip(a, b, strict=True):
        assert x.global_samples == y.global_samples == x.local_samples + y.local_samples
    trace = ProtocolTrace.merge(sorted(tmp_path.glob("trace-*.json")))
    assert all(c > 0 for c in form_early_count(trace)), form_early_count(trace)
    assert trace.protocol["early_form"] == 3
    report = validate_trace(trace)
    assert report.ok, report.reason
    # The trace check can fail: without its early forms it is not a run of the model.
    bad = copy.deepcopy(trace)
    bad.ranks[0].events = [e for e in bad.ranks[0].events if e["action"] != "FormEarly"]
    assert not validate_trace(bad).ok


@pytest.mark.tlc
@pytest.mark.usefixtures("force_early")
def test_a_loader_trace_with_early_forms_passes_the_tlc_trace_check(tmp_path: Path) -> None:
    require_tlc()
    on_ranks(2, make(n=24, trace_dir=tmp_path), to_the_end)
    trace = ProtocolTrace.merge(sorted(tmp_path.glob("trace-*.json")))
    assert all(c > 0 for c in form_early_count(trace))
    report = validate_trace_tlc(trace)
    assert report.ok, report.reason
    bad = copy.deepcopy(trace)
    bad.ranks[1].events = [e for e in bad.ranks[1].events if e["action"] != "FormEarly"]
    assert not validate_trace_tlc(bad).ok


@pytest.mark.usefixtures("force_early")
def test_an_early_form_that_loses_what_it_holds_back_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(RankMachine, "form_early", form_early_dropping_the_rest)
    ranks = on_ranks(2, make(), to_the_end)
    with pytest.raises(AssertionError, match="missing"):
        assert_exactly_once(emitted(ranks[0].infos) + emitted(ranks[1].infos), N)


def test_a_slow_dataset_keeps_every_guarantee_under_the_real_observation() -> None:
    # Whether (and where) early forms happen here depends on timing: only the
    # guarantees are asserted, which hold either way.
    ranks = on_ranks(2, make(delay=0.002, early_form_wait=0.0), to_the_end)
    a, b = (r.infos for r in ranks)
    assert len(a) == len(b)
    assert_exactly_once(emitted(a) + emitted(b), N)


def test_breaking_out_early_stops_the_reader_and_the_next_epoch_runs(
    force_early: None,
) -> None:
    loaders: list[ODBDataLoader] = []

    def body(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
        loaders.append(loader)
        first = until(2)(loader)
        assert loader._pipeline is not None
        look = loader._pipeline._look
        assert look is not None
        loader.close()
        assert not look.alive
        loader.set_epoch(0, repeat=True)
        infos, state = to_the_end(loader)
        return first[0] + infos, state

    ranks = on_ranks(2, make(), body)
    whole = [r.infos[2:] for r in ranks]
    assert len(whole[0]) == len(whole[1])
    assert_exactly_once(emitted(whole[0]) + emitted(whole[1]), N)


# ---- resume --------------------------------------------------------------------


@pytest.mark.usefixtures("force_early")
def test_a_resume_with_early_forms_emits_every_sample_exactly_once() -> None:
    first = on_ranks(2, make(), until(3))
    states = [r.state for r in first]
    done = [i for r in first for i in emitted(r.infos)]

    def resume(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
        loader.load_state_dict(states[loader.rank])
        return to_the_end(loader)

    rest = on_ranks(2, make(), resume)
    a, b = (r.infos for r in rest)
    assert len(a) == len(b) and a[0].step == 3
    assert_exactly_once(done + emitted(a) + emitted(b), N)
    # At another world size, from the merged states: also exactly once.
    one = on_ranks(1, make(), lambda ld: (ld.load_state_dict(states), to_the_end(ld))[1])
    assert_exactly_once(done + emitted(one[0].infos), N)
    # Without the load the check fails: it can catch a resume that repeats samples.
    fresh = on_ranks(2, make(), to_the_end)
    with pytest.raises(AssertionError, match="twice"):
        assert_exactly_once(done + [i for r in fresh for i in emitted(r.infos)], N)


def test_a_state_with_early_forms_names_the_setting_when_loaded_without_it() -> None:
    state = json.loads(json.dumps(on_ranks(1, make(), until(2))[0].state))
    plain = make(early_form=None)(_local())
    with pytest.raises(ResumeStateError, match="early_form"):
        plain.load_state_dict(state)


def _local() -> Any:
    from odb_core.torch.transport import LocalTransport

    return LocalTransport()


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (Lengths(self.n)[i] for i in range(self.n))


@pytest.mark.usefixtures("force_early")
def test_forced_early_forms_over_an_iterable_dataset_keep_exactly_once(tmp_path: Path) -> None:
    def build(transport: Any) -> ODBDataLoader:
        return RankLoader(
            transport,
            Stream(N),
            token_budget=48,
            cost_model="padded",
            buffer_size=12,
            max_steps_per_round=2,
            early_form=3,
            collate_fn=ids_of,
            step_meta=False,
            trace_dir=tmp_path,
        )

    ranks = on_ranks(2, build, to_the_end)
    a, b = (r.infos for r in ranks)
    assert len(a) == len(b)
    assert_exactly_once(emitted(a) + emitted(b), N)
    trace = ProtocolTrace.merge(sorted(tmp_path.glob("trace-*.json")))
    assert all(c > 0 for c in form_early_count(trace))
    assert validate_trace(trace).ok
