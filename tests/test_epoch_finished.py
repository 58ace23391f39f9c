"""A finished epoch is never trained again without saying so: a state saved after an
epoch's last batch continues with the next epoch; set_epoch of a finished epoch
raises EpochFinishedError naming the fix, unless repeat=True."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.errors import EpochFinishedError  # noqa: E402

DATA = [{"input_ids": list(range(1 + i % 5))} for i in range(30)]


def make() -> ODBDataLoader:
    return ODBDataLoader(DATA, token_budget=8, collate_fn=len, shuffle=True, seed=1)


def ids(loader: ODBDataLoader) -> list[int]:
    out: list[int] = []
    for _ in loader:
        assert loader.step_info is not None
        out += loader.step_info.sample_ids
    return out


def closed_state() -> dict[str, object]:
    loader = make()
    ids(loader)
    state: dict[str, object] = json.loads(json.dumps(loader.state_dict()))
    return state


def test_state_saved_at_epoch_end_continues_with_next_epoch() -> None:
    loader = make()
    loader.load_state_dict(closed_state())
    assert loader.resume_report is not None and loader.resume_report.closed
    got = ids(loader)
    assert loader.epoch == 1
    fresh = make()
    fresh.set_epoch(1)
    assert got == ids(fresh)


def test_set_epoch_of_the_loaded_finished_epoch_raises_and_names_the_fix() -> None:
    loader = make()
    loader.load_state_dict(closed_state())
    with pytest.raises(EpochFinishedError, match=r"set_epoch\(1\).*repeat=True"):
        loader.set_epoch(0)
    loader.set_epoch(1)  # the fix it names works
    assert sorted(ids(loader)) == list(range(30))


def test_set_epoch_of_an_epoch_just_completed_raises_unless_repeat() -> None:
    loader = make()
    first = ids(loader)
    with pytest.raises(EpochFinishedError, match="epoch 0 has completed"):
        loader.set_epoch(0)
    loader.set_epoch(0, repeat=True)
    assert ids(loader) == first


def test_a_loop_over_epochs_after_an_end_of_epoch_resume_trains_each_once() -> None:
    loader = make()
    loader.load_state_dict(closed_state())
    rep = loader.resume_report
    assert rep is not None
    trained = 0
    for epoch in range(rep.epoch + rep.closed, 3):
        loader.set_epoch(epoch)
        trained += len(ids(loader))
    assert trained == 2 * 30
