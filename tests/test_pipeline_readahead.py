"""The protocol thread reads the next window ahead while its gate holds it.

With batches ready the machine observes nothing, and the gate holds the thread
while the training loop has `ROUNDS_AHEAD` rounds of steps queued; without a read
ahead the DataLoader workers idled then (they prefetch a few chunks only), and a
large window's refill (4,096 samples) outlasted the queued steps, so the loop
waited at every refill (docs/SIMULATOR.md, early forms). The pipeline now takes
chunks into its own queue of records while gated, up to the room the next fill
will take; the machine observes the same samples in the same order, so the
batches are those of a run without the read ahead (the inline pipeline, which
has no gate). No wall-clock limit: the tests wait on the thread's own signal
that it is blocked at the gate with nothing left to read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from guards import HANG_GUARD_S  # noqa: E402
from test_pipeline_edges import setup as edges_setup  # noqa: E402

from odb_core.config import ProtocolConfig  # noqa: E402
from odb_core.cost import Budget  # noqa: E402
from odb_core.torch.pipeline import EpochPipeline  # noqa: E402
from odb_core.torch.rounds import Emitted, EpochSetup, _End  # noqa: E402
from odb_core.torch.source import Record  # noqa: E402

pytestmark = pytest.mark.torch

WINDOW = 16


def source(n: int, pulled: list[int], fail_at: int | None = None) -> Iterator[list[Record]]:
    """One record of 3 tokens per chunk (budget 8: two samples a batch); raises at
    chunk `fail_at`."""
    for i in range(n):
        if i == fail_at:
            raise RuntimeError(f"chunk {i} failed")
        pulled.append(i)
        yield [(i, {"input_ids": [0] * 3})]


def setup(src: Iterator[Any]) -> EpochSetup:
    config = ProtocolConfig(
        world_size=1, budget=Budget(8), buffer_size=WINDOW, max_steps_per_round=1
    )
    return edges_setup(src, config=config)


def steps_of(p: EpochPipeline) -> list[tuple[int, ...]]:
    out = []
    while True:
        item = p.get()
        if isinstance(item, _End):
            return out
        assert isinstance(item, Emitted)
        out.append(item.info.sample_ids)


def gated(p: EpochPipeline) -> None:
    """Wait until the protocol thread blocks at the gate with nothing to read ahead
    (or ends: then fail at once)."""
    thread = p._thread
    assert thread is not None
    while not p._gate_idle.wait(0.05) and thread.is_alive():
        pass
    assert p._gate_idle.is_set(), "the protocol thread ended before blocking at the gate"


def test_the_gated_thread_reads_the_next_window_ahead_and_the_batches_do_not_change() -> None:
    pulled: list[int] = []
    p = EpochPipeline(setup(source(100, pulled)), threaded=True)
    p.start()
    gated(p)  # the loop has taken nothing: rounds 0-2 ran, round 3 waits
    m = p.s.machine
    # The first window (16) formed 7 batches and kept its open one (2 samples); the
    # thread then read ahead what the next fill takes: 14 records.
    assert len(m.buffer) == 2 and len(m.ready) == 7 - 3
    assert len(p._pending) == WINDOW - len(m.buffer) == 14, "no read ahead at the gate"
    assert pulled == list(range(WINDOW + 14))
    threaded = steps_of(p)
    inline = EpochPipeline(setup(source(100, [])), threaded=False)
    inline.start()
    assert threaded == steps_of(inline)  # the same batches, step for step
    assert sorted(i for ids in threaded for i in ids) == list(range(100))
    p._thread.join(HANG_GUARD_S)  # type: ignore[union-attr]
    assert not p.alive


def test_a_source_error_met_reading_ahead_is_raised_after_the_records_before_it() -> None:
    pulled: list[int] = []
    p = EpochPipeline(setup(source(100, pulled, fail_at=20)), threaded=True)
    p.start()
    gated(p)  # it met the error reading ahead (4 records in), and keeps it for later
    assert pulled == list(range(20)) and len(p._pending) == 4
    taken: list[tuple[int, ...]] = []
    with pytest.raises(RuntimeError, match="chunk 20 failed"):
        while True:
            item = p.get()
            assert isinstance(item, Emitted)
            taken.append(item.info.sample_ids)
    # Every batch of the first window came first (raised at once, the error would
    # have overtaken the 4 steps not yet contributed).
    assert [i for ids in taken for i in ids] == list(range(14))
    p._thread.join(HANG_GUARD_S)  # type: ignore[union-attr]
    assert not p.alive
