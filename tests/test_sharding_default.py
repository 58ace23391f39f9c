"""Which sharding the loader runs when none is given (issue 32): dynamic wherever it
can serve, static where it cannot or where an option needs it; `describe()` says
which and why; states saved under static (every earlier release's) keep resuming."""

from __future__ import annotations

import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_torch_dynamic import Skewed, collate  # noqa: E402
from thread_ranks import RankLoader, on_ranks  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

from odb_core.errors import ConfigError, ResumeStateError  # noqa: E402
from odb_core.step import StepInfo  # noqa: E402
from odb_core.torch.options import DEFAULT_WINDOW_BYTES, LoaderOptions  # noqa: E402

pytestmark = pytest.mark.torch

N = 160
KW: dict[str, Any] = {"collate_fn": collate, "token_budget": 64, "buffer_size": 8,
                      "max_steps_per_round": 4}  # fmt: skip


class Stream(IterableDataset[dict[str, Any]]):
    def __iter__(self) -> Any:
        return iter([])


@pytest.mark.parametrize(
    ("kw", "iterable", "world", "sharding", "why"),
    [
        ({}, False, 2, "dynamic", "default for a sized map-style dataset"),
        ({}, True, 2, "static", "an IterableDataset"),
        ({"partition": False}, False, 2, "static", "partition=False"),
        ({"id_fn": int}, False, 2, "static", "id_fn= given"),
        ({"sampler": [0, 1]}, False, 2, "static", "sampler= given"),
        ({"early_form": 4, "buffer_size": 8}, False, 2, "static", "early_form=4"),
        ({"window_bytes": 123}, False, 2, "static", "window_bytes=123"),
        ({"deterministic": True}, False, 2, "static", "deterministic=True"),
        ({"cost_model": "padded"}, False, 2, "static", "cost_model='padded'"),
        ({"cost_model": "attention"}, False, 2, "dynamic", "map-style"),
        ({}, False, 1, "static", "one rank"),
        ({"sharding": "static"}, False, 2, "static", "sharding='static' given"),
        ({"sharding": "dynamic"}, False, 1, "dynamic", "sharding='dynamic' given"),
    ],
)
def test_dynamic_by_default_where_it_can_serve(
    kw: dict[str, Any], iterable: bool, world: int, sharding: str, why: str
) -> None:
    choice = LoaderOptions.of(token_budget=8, **kw).sharding(iterable=iterable, world=world)
    assert choice.sharding.value == sharding and why in choice.reason


def test_describe_and_the_log_say_what_is_in_force(caplog: pytest.LogCaptureFixture) -> None:
    def body(loader: Any) -> tuple[list[StepInfo], dict[str, Any]]:
        return [], loader.describe()

    with caplog.at_level("INFO", logger="odb_core"):
        results = on_ranks(2, lambda t: RankLoader(t, Skewed(), **KW), body)
    d = results[0].state
    assert d["sharding"] == "dynamic" and "map-style" in d["sharding_reason"]
    assert d["window_bytes"] is None and "static sharding only" in d["window_bytes_reason"]
    assert any("odb: sharding=dynamic" in r.getMessage() for r in caplog.records)
    static = on_ranks(2, lambda t: RankLoader(t, Skewed(), sharding="static", **KW), body)
    assert static[0].state["window_bytes"] == DEFAULT_WINDOW_BYTES
    assert "default under join mode and static" in static[0].state["window_bytes_reason"]


def test_an_explicit_dynamic_where_it_cannot_serve_names_why() -> None:
    with pytest.raises(ConfigError, match="sharding='dynamic' deals dataset indices"):
        RankLoader(_local(), Stream(), sharding="dynamic", **KW)
    with pytest.raises(ConfigError, match="window_bytes=10 needs mode='join' and sharding"):
        RankLoader(_local(), Skewed(), sharding="dynamic", window_bytes=10, **KW)


def _local() -> Any:
    from odb_core.torch.transport import LocalTransport

    return LocalTransport()


def _part(loader: Any, steps: int) -> tuple[list[StepInfo], dict[str, Any]]:
    infos = []
    for _ in loader:
        assert loader.step_info is not None
        infos.append(loader.step_info)
        if len(infos) == steps:
            break
    return infos, json.loads(json.dumps(loader.state_dict()))


def _rest(states: Any) -> Any:
    def body(loader: Any) -> tuple[list[StepInfo], dict[str, Any]]:
        loader.load_state_dict(states(loader.rank))
        infos = []
        for _ in loader:
            assert loader.step_info is not None
            infos.append(loader.step_info)
        return infos, loader.describe()

    return body


def test_states_saved_under_static_keep_resuming_under_the_default() -> None:
    """A state of a run before the default changed (static, per rank) resumes under
    static: each rank its own; the epoch is covered exactly once."""
    first = on_ranks(2, lambda t: RankLoader(t, Skewed(), sharding="static", **KW),
                     lambda dl: _part(dl, 5))  # fmt: skip
    states = [r.state for r in first]
    assert "protocol.sharding" not in states[0]["fingerprint"]
    rest = on_ranks(2, lambda t: RankLoader(t, Skewed(), **KW), _rest(lambda r: states[r]))
    ids = [i for r in first + rest for i in r.ids]
    assert sorted(ids) == list(range(N))
    assert rest[0].state["sharding"] == "static" and "resumed" in rest[0].state["sharding_reason"]
    # A sharding given is kept: the state is refused, naming the option.
    loader = RankLoader(_local(), Skewed(), sharding="dynamic", **KW)
    with pytest.raises(ResumeStateError, match=r"protocol\.sharding.*pass the saved run's"):
        loader.load_state_dict(states)


def test_a_dynamic_run_resumes_from_every_ranks_states_and_refuses_one_alone() -> None:
    first = on_ranks(2, lambda t: RankLoader(t, Skewed(), **KW), lambda dl: _part(dl, 5))
    states = [r.state for r in first]
    assert states[0]["fingerprint"]["protocol.sharding"] == "dynamic"
    with pytest.raises(ResumeStateError, match="resumes from every rank's state"):
        on_ranks(2, lambda t: RankLoader(t, Skewed(), **KW), _rest(lambda r: states[r]))
    rest = on_ranks(2, lambda t: RankLoader(t, Skewed(), **KW), _rest(lambda r: states))
    ids = [i for r in first + rest for i in r.ids]
    assert sorted(ids) == list(range(N))
    # On one rank the default is static; the dynamic state resumes under dynamic.
    one = on_ranks(1, lambda t: RankLoader(t, Skewed(), **KW), _rest(lambda r: states))
    assert one[0].state["sharding"] == "dynamic"
    assert sorted([i for r in first for i in r.ids] + one[0].ids) == list(range(N))


def test_a_dynamic_window_past_the_default_byte_bound_warns_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dynamic sharding bounds the window in samples, not bytes: past the default byte
    bound each rank warns once an epoch, naming the bytes and the settings; static
    sharding, which bounds bytes, does not warn."""
    import warnings

    from odb_core.torch import rounds

    monkeypatch.setattr(rounds, "DEFAULT_WINDOW_BYTES", 64)

    def body(loader: Any) -> tuple[list[StepInfo], dict[str, Any]]:
        return [b["_odb"] if isinstance(b, dict) and "_odb" in b else b for b in loader], {}

    for sharding, expected in (("dynamic", 2), ("static", 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            on_ranks(2, lambda t, s=sharding: RankLoader(t, Skewed(), sharding=s, **KW), body)
        advice = [w for w in caught if "with no byte bound" in str(w.message)]
        assert len(advice) == expected, (sharding, [str(w.message) for w in advice])
        for w in advice:
            assert "window_bytes=" in str(w.message) and "bytes" in str(w.message)


def test_the_advice_is_once_and_never_under_a_bound() -> None:
    import warnings

    from odb_core.torch.held import HeldBytes

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = HeldBytes(None, advise_over=100, rank=3)
        held.arrive(60)
        assert not caught
        held.arrive(60)
        held.arrive(60)
        bounded = HeldBytes(50, advise_over=100)
        bounded.arrive(500)
    assert [str(w.message)[:26] for w in caught] == ["ODBDataLoader rank 3: the "]
    assert "120 bytes" in str(caught[0].message)
