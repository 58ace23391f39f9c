"""Edges of odb_core/torch/pipeline.py that the end-to-end loader tests pass over.

Covered here: `_as_id` (ids from `id_fn`, tensor scalars, bad ids named exactly);
how a failure is reported to the transport (once, ODBError included) and how a peer
failure overtakes the steps already queued; the training loop's wait on a stuck
protocol thread (the peers' verdict, heartbeats only after the transport timeout,
a thread gone without a result); `close()` on threaded and inline
pipelines (bounded join, never-started threads, the source released off the
calling thread); the inline end repeated; the `truncate` oversize policy's
pipeline side (`truncate_fn` arguments, the sample id in its errors, the
consistency check against the protocol's cut); and the exact (deterministic)
resume's replay: pads built from skipped steps, the replay check for a run that
itself started mid-epoch, and its exact error message; the protocol thread (a
daemon named odb-protocol) and how far its gate lets it run ahead, steps finished
after close left uncollated, the close's id check and ledger exchange (their tags,
a peer's bad ledger), the transport flushed before a failure is raised, the round
in flight landing on an inline close, trace files, the epoch stats and `_overlap`,
and pads collating the shortest sample (zero tokens included). Everything runs in one
process (pipelines driven directly, or ranks on threads via tests/thread_ranks.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from thread_ranks import Hub, RankLoader, ThreadTransport, on_ranks  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.config import Mode, ProtocolConfig  # noqa: E402
from odb_core.cost import Budget  # noqa: E402
from odb_core.errors import ODBError, ODBPeerError, SampleError  # noqa: E402
from odb_core.idset import decode  # noqa: E402
from odb_core.protocol import RankMachine, _truncated_tokens  # noqa: E402
from odb_core.sample import Sample  # noqa: E402
from odb_core.step import StepInfo  # noqa: E402
from odb_core.torch import rounds  # noqa: E402
from odb_core.torch.measure import LossTokens  # noqa: E402
from odb_core.torch.pipeline import EpochPipeline  # noqa: E402
from odb_core.torch.rounds import (  # noqa: E402
    Emitted,
    EpochSetup,
    PadTemplate,
    _as_id,
    _End,
)
from odb_core.torch.source import Record  # noqa: E402
from odb_core.torch.transport import Gathering, LocalTransport  # noqa: E402
from odb_core.verify.trace_validation import ProtocolTrace, TracingRankMachine  # noqa: E402

pytestmark = pytest.mark.torch


# ---- helpers ------------------------------------------------------------------------------


class Text(Dataset[dict[str, Any]]):
    """Sample i: `input_ids` of `lengths[i]` tokens (arange) and its index."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": torch.arange(self.lengths[i]), "idx": i}


def collate(samples: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Pads input_ids; a None sample (never collated by a correct pipeline) is idx -1."""
    rows = [torch.arange(0) if s is None else torch.as_tensor(s["input_ids"]) for s in samples]
    return {
        "input_ids": torch.nn.utils.rnn.pad_sequence(rows, batch_first=True),
        "idx": torch.tensor([-1 if s is None else s["idx"] for s in samples]),
    }


def small(n: int) -> list[int]:
    return [1 + (i * 7919) % 9 for i in range(n)]


def text_loader(ds: Any, **kw: Any) -> ODBDataLoader:
    kw.setdefault("token_budget", 24)
    kw.setdefault("buffer_size", 6)
    kw.setdefault("collate_fn", collate)
    return ODBDataLoader(ds, **kw)


Row = tuple[int, tuple[int, ...], list[int]]


def rows_of(dl: ODBDataLoader, it: Iterator[Any] | None = None, stop: int = -1) -> list[Row]:
    """(step, sample ids, the batch's idx) of each step, up to `stop` steps."""
    out: list[Row] = []
    for batch in dl if it is None else it:
        info = dl.step_info
        assert info is not None
        out.append((info.step, info.sample_ids, batch["idx"].tolist()))
        if len(out) == stop:
            break
    return out


def chunks(lengths: Sequence[int]) -> Iterator[list[Record]]:
    """A pipeline source: one record (id, raw sample) per chunk."""
    for i, n in enumerate(lengths):
        yield [(i, {"input_ids": [0] * n})]


def setup(
    source: Iterator[Any],
    transport: Any = None,
    config: ProtocolConfig | None = None,
    **kw: Any,
) -> EpochSetup:
    """One rank of world size 1 over `source` (by default window 4, 2 steps a round),
    collating lists of raw samples."""
    config = config or ProtocolConfig(
        world_size=1, budget=Budget(8), buffer_size=4, max_steps_per_round=2
    )
    return EpochSetup(
        machine=RankMachine(0, config),
        transport=LocalTransport() if transport is None else transport,
        source=source,
        tag=(7,),
        excluded=frozenset(),
        step_offset=0,
        collate=list,
        cost_fn=None,
        loss_tokens=LossTokens(),
        id_fn=None,
        truncate_fn=None,
        pin=None,
        pad_fallback=lambda: None,
        shard=None,
        trace_path=None,
        step_meta=False,
        **kw,
    )


# ---- _as_id ---------------------------------------------------------------------------------


class Scalar:
    """Something with a callable `.item()`, like a numpy or torch scalar."""

    def __init__(self, value: object) -> None:
        self.value = value

    def item(self) -> object:
        return self.value


class NotCallableItem:
    item = 5

    def __repr__(self) -> str:
        return "NotCallableItem()"


def test_as_id_keeps_plain_ints_and_unwraps_item_scalars() -> None:
    assert _as_id(7, 0) == 7
    assert _as_id(0, 3) == 0
    for value in (torch.tensor(5), Scalar(5)):
        got = _as_id(value, 0)
        assert got == 5 and type(got) is int


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (True, "True"),
        ("x", "'x'"),
        (None, "None"),
        (2.0, "2.0"),
        (torch.tensor(1.5), "1.5"),
        (torch.tensor(True), "True"),
        (Scalar("7"), "'7'"),
        (NotCallableItem(), "NotCallableItem()"),
    ],
)
def test_as_id_rejects_what_is_not_an_int_naming_position_and_value(
    value: object, shown: str
) -> None:
    with pytest.raises(SampleError) as err:
        _as_id(value, 4)
    assert str(err.value) == f"sample at position 4: id_fn returned {shown}, not an int"


def test_id_fn_returning_tensor_scalars_gives_the_samples_those_ids() -> None:
    dl = text_loader(Text(small(12)), id_fn=lambda s: torch.tensor(100 + s["idx"]))
    rows = rows_of(dl)
    ids = [i for _, sids, _ in rows for i in sids]
    assert sorted(ids) == list(range(100, 112))
    assert all(type(i) is int for i in ids)
    assert all([i - 100 for i in sids] == idx for _, sids, idx in rows)


# ---- failures: reported once, peer failures first -------------------------------------------


class Reporting(LocalTransport):
    """World size 1 with the failure-note side of a transport."""

    timeout = 0.05  # patience before `waiting()` is entered

    def __init__(self, peers_gone: bool = False) -> None:
        self.reports: list[BaseException] = []
        self.peers_gone = peers_gone

    def report(self, exc: BaseException) -> None:
        self.reports.append(exc)

    def flush(self, wait: float) -> None:
        pass

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        if self.peers_gone:
            raise ODBPeerError("rank 0: the peers' heartbeats stopped")
        yield


@pytest.mark.parametrize("threaded", [True, False])
def test_a_bad_id_fn_value_is_reported_to_the_peers_once(threaded: bool) -> None:
    transport = Reporting()
    dl = RankLoader(
        transport,
        Text(small(8)),
        token_budget=24,
        buffer_size=4,
        collate_fn=collate,
        id_fn=lambda s: "bad" if s["idx"] == 2 else s["idx"],
        prefetch_thread=threaded,
    )
    with pytest.raises(SampleError) as err:
        rows_of(dl)
    assert str(err.value) == "sample at position 2: id_fn returned 'bad', not an int"
    assert transport.reports == [err.value] and transport.reports[0] is err.value


def test_a_rank_stuck_in_its_own_source_raises_the_peer_error_and_reports_only_it() -> None:
    release = threading.Event()

    def stuck() -> Iterator[list[Record]]:
        release.wait(5)
        raise RuntimeError("the source failed late")
        yield []  # a generator

    transport = Reporting(peers_gone=True)
    p = EpochPipeline(setup(stuck(), transport), threaded=True)
    p.start()
    with pytest.raises(ODBPeerError) as first:
        p.get()
    assert str(first.value) == "rank 0: the peers' heartbeats stopped"
    release.set()
    p._thread.join(5)
    assert not p.alive
    # The late failure of the stuck thread is not a second report...
    assert transport.reports == [first.value] and transport.reports[0] is first.value
    # ...and the known peer failure still goes ahead of it.
    with pytest.raises(ODBPeerError) as again:
        p.get()
    assert again.value is first.value


class DiesAtRound(LocalTransport):
    def __init__(self, dead: int) -> None:
        self.dead = dead

    def start(self, tag: tuple[int, ...], vector: Sequence[int]) -> Gathering:
        if tag[-1] == self.dead:
            raise ODBPeerError(f"rank 1 died before round {self.dead}")
        return super().start(tag, vector)


def test_a_peer_failure_overtakes_the_steps_already_queued() -> None:
    p = EpochPipeline(setup(chunks([3] * 12), DiesAtRound(1)), threaded=True)
    p.start()
    p._thread.join(5)
    assert not p.alive and p._queue.qsize() >= 2  # round 0's steps, then the failure
    with pytest.raises(ODBPeerError) as err:
        p.get()
    assert str(err.value) == "rank 1 died before round 1"


class Verdict(LocalTransport):
    """World size 1 whose peers' failure notes are read without a collective."""

    timeout = 0.0  # no patience: never enters `waiting()`

    def __init__(self) -> None:
        self.known = ODBPeerError("rank 1: rank 1 failed and left")

    def verdict(self) -> ODBPeerError | None:
        return self.known


class Patient(LocalTransport):
    """Heartbeats are read (and show the peers gone) only after `timeout` seconds."""

    timeout = 5.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        raise ODBPeerError("rank 0: the peers' heartbeats stopped")
        yield


def stalled(release: threading.Event, wait: float) -> Iterator[list[Record]]:
    """A source stuck (until `release` or `wait` seconds) before its samples."""
    release.wait(wait)
    yield from chunks([3] * 6)


def test_a_rank_stuck_in_its_own_source_raises_the_peers_verdict() -> None:
    release = threading.Event()
    transport = Verdict()
    p = EpochPipeline(setup(stalled(release, 3.0), transport), threaded=True)
    p.start()
    start = time.monotonic()
    try:
        with pytest.raises(ODBPeerError) as err:
            p.get()
        assert time.monotonic() - start < 2.0
    finally:
        release.set()
        p._thread.join(5)
    assert err.value is transport.known


class NoVerdict(Verdict):
    """The peers have said nothing yet: the wait goes on."""

    def verdict(self) -> ODBPeerError | None:
        self.asked = getattr(self, "asked", 0) + 1
        return None


def test_a_slow_source_with_no_peer_verdict_keeps_waiting() -> None:
    release = threading.Event()
    transport = NoVerdict()
    p = EpochPipeline(setup(stalled(release, 0.4), transport), threaded=True)
    p.start()
    try:
        first = p.get()  # 0.4 s stuck: the verdict is read (and empty) on each 0.1 s wait
    finally:
        release.set()
        p._thread.join(5)
    assert isinstance(first, Emitted) and first.info.step == 0
    assert transport.asked >= 1


def test_the_heartbeats_are_read_only_after_the_transport_timeout() -> None:
    release = threading.Event()
    p = EpochPipeline(setup(stalled(release, 0.4), Patient()), threaded=True)
    p.start()
    try:
        first = p.get()  # 0.4 s stuck, well within the 5 s patience
    finally:
        release.set()
        p._thread.join(5)
    assert isinstance(first, Emitted) and first.info.step == 0


def test_get_from_a_protocol_thread_that_ended_without_a_result_raises() -> None:
    p = EpochPipeline(setup(chunks([3, 3])), threaded=True)  # never started
    with pytest.raises(ODBError) as err:
        p.get()
    assert str(err.value) == "the loader's protocol thread ended without a result"


# ---- close ----------------------------------------------------------------------------------


def test_close_of_a_threaded_pipeline_never_started_returns() -> None:
    p = EpochPipeline(setup(chunks([3, 3])), threaded=True)
    p.close(timeout=1.0)
    assert not p.alive


def test_close_waits_for_a_stuck_protocol_thread_at_most_its_timeout() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow() -> Iterator[list[Record]]:
        yield [(0, {"input_ids": [0] * 3})]
        entered.set()
        release.wait(4)
        yield [(1, {"input_ids": [0] * 3})]

    p = EpochPipeline(setup(slow()), threaded=True)
    p.start()
    assert entered.wait(5)
    start = time.monotonic()
    p.close(timeout=0.2)
    elapsed = time.monotonic() - start
    try:
        assert elapsed < 2.0
        assert p.alive  # still stuck in its source: the loader reports that
    finally:
        release.set()
        p._thread.join(5)
    assert not p.alive


def test_inline_close_before_the_end_releases_the_source_off_the_calling_thread() -> None:
    released: list[str] = []
    done = threading.Event()

    def source() -> Iterator[list[Record]]:
        try:
            yield from chunks([3] * 20)
        finally:
            released.append(threading.current_thread().name)
            done.set()

    p = EpochPipeline(setup(source()), threaded=False)
    p.start()
    first = p.get()
    assert isinstance(first, Emitted) and not first.last_of_epoch
    p.close()
    assert done.wait(5)
    assert released == ["odb-release-workers"]
    assert p._finished


def test_inline_get_after_the_end_returns_the_same_end() -> None:
    p = EpochPipeline(setup(chunks([3] * 5)), threaded=False)
    p.start()
    items = [p.get() for _ in range(6)]
    ends = [i for i in items if isinstance(i, _End)]
    assert ends, "five samples end within six gets"
    end = ends[0]
    assert all(i is end for i in items[items.index(end) :])
    assert p.get() is end
    p.close()
    assert p.get() is end


# ---- truncate ---------------------------------------------------------------------------------


def test_truncate_fn_gets_the_raw_sample_and_the_kept_count() -> None:
    calls: list[tuple[int, int, int]] = []

    def cut(raw: dict[str, Any], keep: int) -> dict[str, Any]:
        calls.append((raw["idx"], len(raw["input_ids"]), keep))
        return {**raw, "input_ids": raw["input_ids"][:keep]}

    dl = text_loader(Text([3, 100, 3, 3]), token_budget=50, oversize="truncate", truncate_fn=cut)
    widths = {}
    for batch in dl:
        info = dl.step_info
        assert info is not None
        if 1 in info.sample_ids:
            assert info.truncated == ((1, 50),)
            widths[1] = batch["input_ids"].shape[1]
            assert batch["idx"].tolist() == [1]
    assert calls == [(1, 100, 50)]
    assert widths == {1: 50}


def test_default_truncate_names_the_sample_it_cannot_cut() -> None:
    class Lists(Dataset[list[int]]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> list[int]:
            return [i] * (100 if i == 2 else 3)

    dl = ODBDataLoader(
        Lists(),
        token_budget=50,
        buffer_size=4,
        oversize="truncate",
        cost_fn=len,
        collate_fn=list,
    )
    with pytest.raises(SampleError) as err:
        list(dl)
    assert str(err.value) == ("sample 2: oversize='truncate' needs truncate_fn= for a list sample")


def test_loss_tokens_of_a_truncated_sample_name_the_sample_when_they_fail() -> None:
    def loss_tokens(sample: dict[str, Any]) -> int:
        n = len(sample["input_ids"])
        if n == 50:
            raise ValueError("cut to 50")
        return n

    dl = text_loader(
        Text([3, 3, 100, 3]), token_budget=50, oversize="truncate", loss_tokens_fn=loss_tokens
    )
    with pytest.raises(SampleError) as err:
        list(dl)
    assert str(err.value) == "sample 2: loss_tokens_fn raised ValueError('cut to 50')"


def test_a_cut_that_differs_from_the_protocols_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def one_less(sample: Sample, config: ProtocolConfig) -> int | None:
        kept = _truncated_tokens(sample, config)
        return None if kept is None else kept - 1

    monkeypatch.setattr(rounds, "_truncated_tokens", one_less)
    dl = text_loader(Text([3, 100, 3, 3]), token_budget=50, oversize="truncate")
    with pytest.raises(ODBError) as err:
        list(dl)
    assert str(err.value) == (
        "sample 1: truncated to 49 tokens before observing, but the protocol kept 50"
    )


# ---- exact resume: the replay -------------------------------------------------------------------


def test_an_exact_resume_drops_the_data_of_the_steps_it_skips() -> None:
    lengths = [3, 40, 3, 5, 2, 4, 6, 3, 2, 5, 4, 3, 6, 2, 3, 4]
    kw: dict[str, Any] = {
        "deterministic": True,
        "oversize": "truncate",
        "max_steps_per_round": 1,
        "prefetch_thread": False,
    }
    full = rows_of(text_loader(Text(lengths), **kw))
    (cut_step,) = [n for n, (_, sids, _) in enumerate(full) if 1 in sids]
    stop = cut_step + 1
    assert stop < len(full) - 1
    dl = text_loader(Text(lengths), **kw)
    assert rows_of(dl, iter(dl), stop) == full[:stop]
    state = json.loads(json.dumps(dl.state_dict()))
    fresh = text_loader(Text(lengths), **kw)
    fresh.load_state_dict(state)
    it = iter(fresh)
    assert rows_of(fresh, it, 1) == full[stop : stop + 1]
    p = fresh._pipeline
    assert p is not None
    assert p._replay_checked is True
    assert p._skipped == stop
    assert p._replayed == decode(state["done"], "done")
    assert not decode(state["done"], "done") & (set(p._raw) | set(p._cut))
    assert rows_of(fresh, it) == full[stop + 1 :]


# Rank 1 holds three samples and pads while rank 0 still trains.
SHARDS = [list(range(16)), [16, 17, 18]]


def two_ranks(states: list[dict[str, Any]] | None = None) -> Callable[[Any], ODBDataLoader]:
    def build(transport: Any) -> ODBDataLoader:
        dl = RankLoader(
            transport,
            Text([2 + (i * 7919) % 19 for i in range(19)]),
            token_budget=40,
            buffer_size=4,
            max_steps_per_round=2,
            collate_fn=collate,
            sampler=SHARDS[transport.rank],
            partition=False,
            deterministic=True,
        )
        if states is not None:
            dl.load_state_dict(states[transport.rank])
        return dl

    return build


def recording(stop: int = -1) -> Callable[[ODBDataLoader], tuple[list[StepInfo], dict[str, Any]]]:
    def body(dl: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
        infos: list[StepInfo] = []
        rows: list[Row] = []
        dl.__dict__["rows"] = rows
        for batch in dl:
            assert dl.step_info is not None
            infos.append(dl.step_info)
            rows.append((dl.step_info.step, dl.step_info.sample_ids, batch["idx"].tolist()))
            if len(infos) == stop:
                break
        return infos, json.loads(json.dumps(dl.state_dict()))

    return body


def test_pads_after_an_exact_resume_collate_the_shortest_sample_of_the_skipped_steps() -> None:
    whole = on_ranks(2, two_ranks(), recording())
    real = [n for n, info in enumerate(whole[1].infos) if not info.is_pad]
    stop = real[-1] + 1  # rank 1 emitted all its samples before the resume point
    assert stop < len(whole[1].infos), "rank 1 pads after the resume point"
    shortest = min(SHARDS[1], key=lambda i: (2 + (i * 7919) % 19, i))
    pads = whole[1].loader.__dict__["rows"][stop:]
    assert pads and all(idx == [shortest] for _, _, idx in pads)
    before = on_ranks(2, two_ranks(), recording(stop))
    after = on_ranks(2, two_ranks([r.state for r in before]), recording())
    for r in range(2):
        assert after[r].loader.__dict__["rows"] == whole[r].loader.__dict__["rows"][stop:]


def test_an_exact_resume_of_a_run_that_started_mid_epoch_replays_from_that_start() -> None:
    ds = Text(small(40))
    kw: dict[str, Any] = {"deterministic": True, "max_steps_per_round": 1}
    full = rows_of(text_loader(ds, **kw))
    assert len(full) > 6
    first = text_loader(ds, **kw)
    assert rows_of(first, iter(first), 2) == full[:2]
    merged = text_loader(ds, **kw)
    merged.load_state_dict([first.state_dict()])  # a merged state: not an exact resume
    it = iter(merged)
    assert rows_of(merged, it, 2) == full[2:4]
    state = json.loads(json.dumps(merged.state_dict()))
    assert (state["start_step"], state["step"]) == (2, 4)
    exact = text_loader(ds, **kw)
    exact.load_state_dict(state)
    assert rows_of(exact) == full[4:]


OFFSET = [0]


def test_an_exact_resume_over_other_samples_raises_naming_ten_of_each() -> None:
    ds = Text(small(60))
    kw: dict[str, Any] = {
        "deterministic": True,
        "max_steps_per_round": 1,
        "id_fn": lambda s: s["idx"] + OFFSET[0],
    }
    dl = text_loader(ds, **kw)
    head = rows_of(dl, iter(dl), 5)
    state = json.loads(json.dumps(dl.state_dict()))
    done = sorted(decode(state["done"], "done"))
    assert len(done) > 10
    OFFSET[0] = 1000
    try:
        fresh = text_loader(ds, **kw)
        fresh.load_state_dict(state)
        with pytest.raises(ODBError) as err:
            rows_of(fresh)
    finally:
        OFFSET[0] = 0
    assert len(head) == 5
    missing = done[:10]
    extra = [1000 + i for i in done[:10]]
    assert str(err.value) == (
        "rank 0: the exact resume replayed 5 steps up to the saved step 5 (expected 5) and "
        f"emitted other samples than the saved state records (missing {missing}, unexpected "
        f"{extra}): deterministic=True needs a dataset that yields the same samples in "
        "every run"
    )


# ---- the protocol thread, the gate and the exchanges ------------------------------------------


class Recording(LocalTransport):
    """World size 1 that records the tags it starts and its exchanges (tag, ids, what)."""

    def __init__(self) -> None:
        self.starts: list[tuple[int, ...]] = []
        self.exchanges: list[tuple[tuple[int, ...], list[int], str]] = []
        self.flushes: list[float] = []

    def start(self, tag: tuple[int, ...], vector: Sequence[int]) -> Gathering:
        self.starts.append(tag)
        return super().start(tag, vector)

    def exchange(
        self, tag: tuple[int, ...], ids: Sequence[int], what: str = "an exchange"
    ) -> list[list[int]]:
        self.exchanges.append((tag, list(ids), what))
        return super().exchange(tag, ids, what)

    def flush(self, wait: float) -> None:
        self.flushes.append(wait)


def drain(p: EpochPipeline) -> tuple[list[Emitted], _End]:
    """Every step of the epoch, then its end."""
    steps: list[Emitted] = []
    while True:
        item = p.get()
        if isinstance(item, _End):
            return steps, item
        steps.append(item)


def settles_at(starts: list[tuple[int, ...]], n: int) -> int:
    """How many rounds were started once `n` have been and the thread waited a while."""
    deadline = time.monotonic() + 5
    while len(starts) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.25)
    return len(starts)


def test_the_protocol_runs_on_a_daemon_thread_named_odb_protocol() -> None:
    seen: list[tuple[str, bool]] = []

    def source() -> Iterator[list[Record]]:
        seen.append((threading.current_thread().name, threading.current_thread().daemon))
        yield from chunks([3] * 4)

    p = EpochPipeline(setup(source()), threaded=True)
    p.start()
    steps, _ = drain(p)
    p._thread.join(5)
    assert [s.info.sample_ids for s in steps] == [(0, 1), (2, 3)]
    assert seen == [("odb-protocol", True)]


@pytest.mark.parametrize(("skip", "ahead"), [(0, 3), (2, 5), (3, 6)])
def test_the_thread_runs_rounds_ahead_of_the_steps_taken_skipped_ones_included(
    skip: int, ahead: int
) -> None:
    # One step per round here: round r waits until the loop took r - 2 steps.
    transport = Recording()
    replayed = frozenset(range(2 * skip))
    s = setup(chunks([3] * 40), transport, skip_before=skip, replay_ids=replayed)
    p = EpochPipeline(s, threaded=True)
    p.start()
    try:
        assert settles_at(transport.starts, ahead) == ahead
        assert p._taken == skip
        first = p.get()
        assert isinstance(first, Emitted) and first.info.step == skip
        assert p._taken == skip + 1
        assert settles_at(transport.starts, ahead + 1) == ahead + 1
        steps, end = drain(p)
    finally:
        p.close(timeout=5)
    assert [e.info.step for e in [first, *steps]] == list(range(skip, 20))
    assert p._taken == 20
    assert transport.starts == [(7, r) for r in range(20)]
    assert end.stats.rounds == 20


def test_the_close_exchanges_the_ids_under_the_rounds_tag_in_join_mode() -> None:
    transport = Recording()
    p = EpochPipeline(setup(chunks([3] * 6), transport), threaded=False)
    steps, end = drain(p)
    assert [s.info.sample_ids for s in steps] == [(0, 1), (2, 3), (4, 5)]
    assert end.stats.rounds == 3 and end.ledger == ()
    assert transport.exchanges == [
        ((7, 3, -3), [0, 1, 2, 3, 4, 5], "the cross-rank id check at the close")
    ]


def quota_setup(source: Iterator[Any], transport: Any, shard: list[int]) -> EpochSetup:
    s = setup(source, transport)
    config = dataclasses.replace(s.machine.config, mode=Mode.QUOTA)
    return dataclasses.replace(s, machine=RankMachine(0, config), shard=shard)


def test_the_quota_close_exchanges_the_ledger_under_the_rounds_tag() -> None:
    transport = Recording()
    p = EpochPipeline(quota_setup(chunks([3] * 6), transport, list(range(8))), threaded=False)
    steps, end = drain(p)
    assert [s.info.sample_ids for s in steps] == [(0, 1), (2, 3), (4, 5)]
    assert end.stats.rounds == 3
    assert transport.exchanges == [
        ((7, 3, -3), [0, 1, 2, 3, 4, 5, 6, 7], "the cross-rank id check at the close"),
        ((7, 3), [6, 7], "an exchange"),
    ]
    assert end.ledger == ((6, 7),) and steps[-1].ledger == ((6, 7),)
    assert [s.ledger for s in steps[:-1]] == [(), ()]


@pytest.mark.parametrize(
    ("step_offset", "window_offset", "first"), [(5, 0, (5, 0)), (0, 3, (0, 3)), (5, 3, (5, 3))]
)
def test_offsets_of_a_resumed_incarnation_shift_steps_and_windows_alone(
    step_offset: int, window_offset: int, first: tuple[int, int]
) -> None:
    s = setup(chunks([3] * 4), window_offset=window_offset)
    s.step_offset = step_offset
    p = EpochPipeline(s, threaded=False)
    steps, _ = drain(p)
    got = [(e.info.step, e.info.window) for e in steps]
    assert got == [first, (first[0] + 1, first[1] + 1)]


def test_steps_the_thread_finishes_after_close_are_not_collated() -> None:
    collated: list[list[Any]] = []

    def collate_list(raws: list[Any]) -> list[Any]:
        collated.append(raws)
        return raws

    entered, release = threading.Event(), threading.Event()

    def source() -> Iterator[list[Record]]:
        entered.set()
        release.wait(5)
        yield from chunks([3] * 40)

    transport = Recording()
    s = setup(source(), transport)
    s.collate = collate_list
    p = EpochPipeline(s, threaded=True)
    p.start()
    assert entered.wait(5)
    p.close(timeout=0.0)
    release.set()
    p._thread.join(5)
    assert not p.alive
    # Rounds 0-2 need no step taken; round 3 waits for one, and the loop has stopped.
    steps = [p.get() for _ in range(3)]
    assert [(e.info.sample_ids, e.batch) for e in steps] == [
        ((0, 1), None),
        ((2, 3), None),
        ((4, 5), None),
    ]
    with pytest.raises(ODBError) as err:
        p.get()
    assert str(err.value) == "the loader was closed before the epoch ended"
    assert collated == []
    assert transport.flushes == [1.0]
    assert transport.starts == [(7, 0), (7, 1), (7, 2)]


def test_a_failure_flushes_the_transport_before_it_is_raised() -> None:
    def source() -> Iterator[list[Record]]:
        yield from chunks([3] * 2)
        raise RuntimeError("the source broke")

    transport = Recording()
    p = EpochPipeline(setup(source(), transport), threaded=False)
    with pytest.raises(RuntimeError) as err:
        drain(p)
    assert str(err.value) == "the source broke"
    assert transport.flushes == [1.0]


def test_a_protocol_thread_gone_without_a_result_flushes_the_transport() -> None:
    transport = Recording()
    p = EpochPipeline(setup(chunks([3, 3]), transport), threaded=True)  # never started
    with pytest.raises(ODBError) as err:
        p.get()
    assert str(err.value) == "the loader's protocol thread ended without a result"
    assert transport.flushes == [1.0]


class FailsLate(LocalTransport):
    """Round 0 lands; every later round's all-gather fails when waited on."""

    def __init__(self) -> None:
        self.waited: list[tuple[int, ...]] = []

    def start(self, tag: tuple[int, ...], vector: Sequence[int]) -> Gathering:
        outer = self
        rows = [list(vector)]

        class Late:
            def done(self) -> bool:
                return False

            def wait(self) -> list[list[int]]:
                outer.waited.append(tag)
                if tag[-1] > 0:
                    raise ODBPeerError(f"rank 1 left in round {tag[-1]}")
                return rows

        return Late()


def test_inline_close_lets_the_round_in_flight_land_and_ignores_its_peer_error() -> None:
    transport = FailsLate()
    p = EpochPipeline(setup(chunks([3] * 20), transport), threaded=False)
    first = p.get()  # round 1 is issued before round 0's step is handed out
    assert isinstance(first, Emitted) and first.info.sample_ids == (0, 1)
    assert transport.waited == [(7, 0)]
    p.close()
    assert transport.waited == [(7, 0), (7, 1)]
    assert p._finished and p._in_flight is None


def test_a_trace_is_saved_into_directories_it_creates(tmp_path: Any) -> None:
    s = setup(chunks([3] * 4))
    s.machine = TracingRankMachine(0, s.machine.config)
    s.trace_path = tmp_path / "a" / "b" / "trace.json"
    steps, _ = drain(EpochPipeline(s, threaded=False))
    assert [e.info.sample_ids for e in steps] == [(0, 1), (2, 3)]
    trace = ProtocolTrace.load(s.trace_path)
    assert [r.rank for r in trace.ranks] == [0]
    assert trace.ranks[0].scales == [1.0, 1.0]


@pytest.mark.parametrize("tracing", [True, False])
def test_no_trace_is_saved_without_both_a_path_and_a_tracing_machine(
    tracing: bool, tmp_path: Any
) -> None:
    s = setup(chunks([3] * 4))
    if tracing:
        s.machine = TracingRankMachine(0, s.machine.config)
    else:
        s.trace_path = tmp_path / "trace.json"
    steps, end = drain(EpochPipeline(s, threaded=False))
    assert [e.info.sample_ids for e in steps] == [(0, 1), (2, 3)]
    assert end.stats.rounds == 2
    assert list(tmp_path.iterdir()) == []


def test_round_waits_are_durations() -> None:
    start = time.perf_counter()
    steps, end = drain(EpochPipeline(setup(chunks([3] * 6)), threaded=False))
    elapsed = time.perf_counter() - start
    assert len(steps) == 3
    assert end.stats.collectives == 3 and len(end.stats.round_wait_s) == 3
    assert all(0.0 <= w <= elapsed for w in end.stats.round_wait_s)
    assert 0.0 <= end.stats.collective_stall_s <= end.stats.stall_s <= elapsed


@pytest.mark.parametrize(
    ("xs", "ys", "total"),
    [
        ([(0.0, 1.0)], [(0.0, 1.0)], 1.0),
        ([(0.0, 2.0)], [(1.0, 3.0)], 1.0),
        ([(1.0, 3.0)], [(0.0, 2.0)], 1.0),
        ([(0.0, 10.0)], [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)], 3.0),
        ([(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)], [(0.0, 10.0)], 3.0),
        ([(0.0, 1.0), (2.0, 3.0)], [(1.0, 2.0)], 0.0),
        ([], [(0.0, 1.0)], 0.0),
    ],
)
def test_overlap_is_the_length_of_the_intersection(
    xs: list[tuple[float, float]], ys: list[tuple[float, float]], total: float
) -> None:
    assert rounds._overlap(xs, ys) == total


def test_the_pad_template_keeps_the_first_shortest_sample_zero_tokens_included() -> None:
    pad = PadTemplate()
    assert (pad.sample, pad.length) == (None, -1)
    pad.offer("empty", 0)
    pad.offer("five", 5)
    pad.offer("other empty", 0)
    assert (pad.sample, pad.length) == ("empty", 0)
    pad = PadTemplate()
    pad.offer("three", 3)
    pad.offer("other three", 3)
    assert (pad.sample, pad.length) == ("three", 3)
    pad.offer("two", 2)
    assert (pad.sample, pad.length) == ("two", 2)


# ---- two ranks of pipelines on threads ----------------------------------------------------------


def on_two(
    sources: list[Iterator[list[Record]]],
    transport: Callable[[Hub, int], Any] = ThreadTransport,
    mode: Mode = Mode.JOIN,
) -> list[tuple[list[Emitted], _End] | BaseException]:
    """Two inline pipelines (ranks 0 and 1) over an in-memory all-gather, on threads."""
    hub = Hub(2)
    config = ProtocolConfig(
        world_size=2, budget=Budget(8), buffer_size=4, max_steps_per_round=2, mode=mode
    )

    def rank(r: int) -> tuple[list[Emitted], _End] | BaseException:
        s = setup(sources[r], transport(hub, r))
        s.machine = RankMachine(r, config)
        s.pad_fallback = lambda: "fallback"
        try:
            return drain(EpochPipeline(s, threaded=False))
        except ODBError as exc:
            return exc

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(rank, range(2)))


def test_pads_collate_the_ranks_shortest_sample_even_of_zero_tokens() -> None:
    empty = {"input_ids": []}
    results = on_two([chunks([3] * 8), iter([[(100, empty)]])])
    first, second = results
    assert not isinstance(first, BaseException) and not isinstance(second, BaseException)
    assert [e.info.sample_ids for e in first[0]] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    got = [(e.info.sample_ids, e.batch) for e in second[0]]
    assert got == [((100,), [empty])] + [((), [empty])] * 3


class Tampered(ThreadTransport):
    """Rank 0 receives a peer's quota ledger that holds one id twice."""

    def exchange(
        self, tag: tuple[int, ...], ids: Sequence[int], what: str = "an exchange"
    ) -> list[list[int]]:
        rows = super().exchange(tag, ids, what)
        if self.rank == 0 and len(tag) == 2:  # the ledger, not the id check
            rows[1] = [*rows[1], 99, 99]
        return rows


def test_inconsistent_ledgers_from_peers_raise_a_peer_error_naming_the_fault() -> None:
    peer = iter([[(100 + i, {"input_ids": [0] * 3})] for i in range(4)])
    first, second = on_two([chunks([3] * 4), peer], Tampered, Mode.QUOTA)
    assert isinstance(first, ODBPeerError)
    assert str(first) == (
        "rank 0: inconsistent ledgers from peers: sample id 99 is in the ledger twice"
    )
    assert not isinstance(second, BaseException)
    assert second[1].ledger == ((), ())
