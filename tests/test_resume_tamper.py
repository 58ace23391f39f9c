"""Tampered, corrupted or mismatched resume state: each case is refused, or shown
harmless.

Refused means: `load_state_dict` raises a `ResumeStateError` (schema, version,
checksum, dataset, config, internal consistency), or the first iteration after
the load raises a `ResumeMismatchError` on every rank (the one collective in
which the ranks compare what they loaded); either way nothing of the state is
applied (the loader is as before the load, and a fresh epoch follows).
Harmless means: the resumed run still emits every sample of the epoch exactly
once (shown by running it).

The single-process cases run at world size 1 (the cross-rank check runs there
too, over one claim); the cross-rank cases run on two real gloo processes, all in
one launch. Every state is taken from a real run; a tamper that edits content
re-seals it (`odb_core.resume.seal`), so the check named in the case, not the
checksum, is what refuses it (the checksum cases show what the checksum alone
catches).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import Dataset  # noqa: E402

from odb_core import ODBDataLoader, ResumeMismatchError, ResumeStateError  # noqa: E402
from odb_core.errors import ODBError  # noqa: E402
from odb_core.idset import decode, encode, ranges_of  # noqa: E402
from odb_core.resume import STATE_VERSION, seal  # noqa: E402

pytestmark = pytest.mark.torch

N = 60


class Text(Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"input_ids": torch.full((1 + (i * 7919) % 29,), i % 100)}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ids = [s["input_ids"] for s in samples]
    return {"input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)}


KW: dict[str, Any] = {
    "token_budget": 64,
    "buffer_size": 8,
    "max_steps_per_round": 2,
    "shuffle": True,
    "seed": 5,
    "collate_fn": collate,
    "prefetch_thread": False,
    # The tampered states are per-rank ones, which resume under static sharding (a
    # dynamic loader takes only merged ones: tests/test_torch_dynamic.py).
    "sharding": "static",
}


def loader(n: int = N, **kw: Any) -> ODBDataLoader:
    return ODBDataLoader(Text(n), **{**KW, **kw})


def ids_of(dl: ODBDataLoader, batches: Any) -> list[int]:
    out = []
    for _ in batches:
        assert dl.step_info is not None
        out.extend(dl.step_info.sample_ids)
    return out


def run_to(stop: int, **kw: Any) -> tuple[list[int], dict[str, Any]]:
    """Ids emitted in the first `stop` steps, and the state after them (plain data)."""
    dl = loader(**kw)
    it = iter(dl)
    before = ids_of(dl, (next(it) for _ in range(stop)))
    return before, json.loads(json.dumps(dl.state_dict()))


def edit(**fields: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda s: seal({**s, **fields})


def range_ids(compact: Any) -> list[int]:
    """The ids of a state's compact id set (ranges or bitmap), sorted."""
    return sorted(decode(compact, "done"))


def with_done(f: Callable[[list[int], list[int]], list[int]]) -> Callable[..., dict[str, Any]]:
    """Re-seal after `done := f(done, ids not emitted)` (as canonical ranges)."""

    def tamper(s: dict[str, Any]) -> dict[str, Any]:
        done = range_ids(s["done"])
        unemitted = sorted(set(range(N)) - set(done))
        return seal({**s, "done": ranges_of(f(done, unemitted))})

    return tamper


def unsealed(**fields: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda s: {**s, **fields}


def flip_checksum(s: dict[str, Any]) -> dict[str, Any]:
    c = s["checksum"]
    return {**s, "checksum": c[:-1] + ("0" if c[-1] != "0" else "1")}


def without(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda s: {k: v for k, v in s.items() if k != key}


# (tamper, loader kwargs of the loader that loads it, what refuses it). Every one is
# refused at load_state_dict, before anything is applied.
AT_LOAD: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], dict[str, Any], str]] = {
    "checksum missing": (without("checksum"), {}, "no checksum"),
    "checksum bit flipped": (flip_checksum, {}, "checksum mismatch"),
    "content edited, not re-sealed": (unsealed(emitted=3), {}, "checksum mismatch"),
    "older version 3": (edit(version=3), {}, "version 3, expected 4: it was saved by an older"),
    "older version 2": (edit(version=2), {}, "version 2, expected 4: it was saved by an older"),
    "future version": (edit(version=STATE_VERSION + 1), {}, "version 5, expected 4"),
    "version as a string": (edit(version="4"), {}, "version '4', expected 4"),
    "another format": (edit(format="x"), {}, "not an ODBDataLoader state"),
    "missing field": (lambda s: seal(without("window")(s)), {}, "missing the field 'window'"),
    "unknown extra field": (edit(extra=1), {}, "unknown field"),
    "not plain data (a set)": (unsealed(done={1, 2}), {}, "holds a set"),
    "not plain data (a tensor)": (unsealed(step=torch.tensor(4)), {}, "holds a Tensor"),
    "negative step": (edit(step=-1), {}, "step=-1 must be a non-negative integer"),
    "step as a string": (edit(step="4"), {}, "step='4' must be a non-negative integer"),
    "step as a float": (edit(step=4.0), {}, "step=4.0 must be a non-negative integer"),
    "step as a bool": (edit(step=True), {}, "step=True must be a non-negative integer"),
    "closed as an int": (edit(closed=1), {}, "closed=1 must be a bool"),
    "duplicate id in done": (
        lambda s: seal({**s, "done": ranges_of(range_ids(s["done"])) * 2}),
        {},
        r"done\[\d+\]=.* overlaps, touches or precedes",
    ),
    "ids as a list, not ranges": (
        lambda s: seal({**s, "done": range_ids(s["done"])}),
        {},
        r"done\[0\]=\d+ is not a \[start, stop\] pair",
    ),
    "done id out of range": (with_done(lambda d, u: [*d[1:], N]), {}, f"holds id {N}, which is"),
    "negative done id": (with_done(lambda d, u: [*d[1:], -1]), {}, "holds id -1, which is not"),
    "id in done and base_done": (
        lambda s: seal({**s, "base_done": encode(range_ids(s["done"])[:1]), "start_emitted": 1}),
        {},
        "is in both base_done and done",
    ),
    "fingerprint emptied": (edit(fingerprint={}), {}, "from another dataset or config"),
    "state of another seed": (lambda s: s, {"seed": 6}, "seed: saved=5 now=6"),
    "dataset of another length": (lambda s: s, {"n": N + 1}, "length: saved=60 now=61"),
    "another token budget": (lambda s: s, {"token_budget": 65}, "budget_tokens"),
    "closed=true mid-epoch": (edit(closed=True), {}, "closed=true but emitted=.* would be lost"),
    "step advanced by 5": (
        lambda s: seal({**s, "step": s["step"] + 5}),
        {},
        "step and window counts disagree",
    ),
    "fewer samples than steps": (edit(emitted=1), {}, "every step emits at least one sample"),
    # At world size 1 the state's own count already says so; at 2 the collective does.
    "one unemitted id added to done": (
        with_done(lambda d, u: [*d, u[0]]),
        {},
        "ids never emitted are marked done",
    ),
    "emitted below the done count": (
        lambda s: seal({**s, "emitted": s["step"]}),
        {},
        "ids never emitted are marked done",
    ),
    "start_step after step": (
        lambda s: seal({**s, "start_step": s["step"] + 1}),
        {},
        "start_step=.* > step",
    ),
    "state of rank 1 of 2 at world size 1": (
        edit(world_size=2, rank=1),
        {},
        "belongs to rank 1 of world size 2",
    ),
    "rank outside the world": (edit(world_size=2, rank=2), {}, r"rank=2 is not in \[0, "),
    "rank null, world size set": (edit(rank=None), {}, "both must be set"),
    "merged state with per-rank done": (
        edit(rank=None, world_size=None),
        {},
        "merged .* done must be empty",
    ),
    "carry holds an id twice": (edit(carry=[[1, 1]]), {}, "carry: sample id 1 is in the ledger"),
    "fingerprint not a mapping": (edit(fingerprint=[1]), {}, "fingerprint=.* must be a mapping"),
}


@pytest.fixture(scope="module")
def saved() -> tuple[list[int], dict[str, Any]]:
    return run_to(4)


@pytest.mark.parametrize("case", list(AT_LOAD))
def test_refused_at_load_and_nothing_applied(
    case: str, saved: tuple[list[int], dict[str, Any]]
) -> None:
    tamper, kw, needle = AT_LOAD[case]
    dl = loader(**kw)
    untouched = dl.state_dict()
    with pytest.raises(ResumeStateError, match=needle):
        dl.load_state_dict(tamper(dict(saved[1])))
    assert dl.state_dict() == untouched
    if case == "checksum bit flipped":  # and a whole fresh epoch follows
        assert sorted(ids_of(dl, dl)) == list(range(N))


# Refused at the first iteration: the cross-rank count (here over one rank) finds
# the done ids do not account for the samples emitted.
AT_FIRST_ITERATION = {
    "one emitted id removed from done": with_done(lambda d, u: d[1:]),
    "emitted advanced by 3": lambda s: seal({**s, "emitted": s["emitted"] + 3}),
}


@pytest.mark.parametrize("case", list(AT_FIRST_ITERATION))
def test_refused_at_the_first_iteration_and_undone(
    case: str, saved: tuple[list[int], dict[str, Any]]
) -> None:
    dl = loader()
    untouched = dl.state_dict()
    dl.load_state_dict(AT_FIRST_ITERATION[case](dict(saved[1])))
    with pytest.raises(ResumeMismatchError, match="do not account for emitted") as err:
        iter(dl)
    assert err.value.field == "done"
    assert dl.state_dict() == untouched  # the load was undone
    assert sorted(ids_of(dl, dl)) == list(range(N))  # a fresh epoch, not a half resume


def test_the_checksum_is_what_catches_a_consistent_edit(
    saved: tuple[list[int], dict[str, Any]],
) -> None:
    """Swap one done id for an unemitted one: every consistency check still holds
    (same count, ids of this rank), so only the checksum can refuse it. Re-sealed,
    it loads and loses one sample while duplicating another: the checksum check
    is needed and does catch it."""
    before, state = saved
    swap = with_done(lambda d, u: [*d[1:], u[0]])(dict(state))
    with pytest.raises(ResumeStateError, match="checksum mismatch"):
        loader().load_state_dict({**swap, "checksum": state["checksum"]})
    dl = loader()
    dl.load_state_dict(swap)
    after = ids_of(dl, dl)
    assert sorted(before + after) != list(range(N))


def test_step_and_window_advanced_together_is_harmless_or_refused(
    saved: tuple[list[int], dict[str, Any]],
) -> None:
    """Provably harmless for identity: a resumed rank's samples are a function of
    (epoch order, world, rank, base_done, done), never of the step, so only the
    step labels move by 5. With deterministic=True (an exact replay up to the
    saved step) it is refused: the replay emits other samples than the state."""
    before, state = saved
    plus5 = seal({**state, "step": state["step"] + 5, "window": state["window"] + 5})
    dl = loader()
    dl.load_state_dict(plus5)
    it = iter(dl)
    next(it)
    assert dl.step_info is not None and dl.step_info.step == state["step"] + 5
    after = [*dl.step_info.sample_ids, *ids_of(dl, it)]
    assert sorted(before + after) == list(range(N))

    _, state_d = run_to(4, deterministic=True)
    exact = loader(deterministic=True)
    exact.load_state_dict(
        seal({**state_d, "step": state_d["step"] + 5, "window": state_d["window"] + 5})
    )
    with pytest.raises(ODBError, match="exact resume replayed"):
        list(exact)


def test_an_untouched_state_resumes_exactly_once(saved: tuple[list[int], dict[str, Any]]) -> None:
    """The control: the checks refuse no state the loader wrote."""
    before, state = saved
    dl = loader()
    dl.load_state_dict(state)
    assert sorted(before + ids_of(dl, dl)) == list(range(N))
    closed = json.loads(json.dumps(dl.state_dict()))
    assert closed["closed"] is True
    again = loader()
    again.load_state_dict(closed)  # a closed state: iterating starts the next epoch
    assert sorted(ids_of(again, again)) == list(range(N)) and again.epoch == 1


# ---- two real gloo ranks ------------------------------------------------------------

CROSS_N = 160


def _gloo_loader(**kw: Any) -> ODBDataLoader:
    return ODBDataLoader(
        Text(CROSS_N),
        token_budget=32,
        buffer_size=8,
        max_steps_per_round=4,
        collate_fn=collate,
        sharding="static",  # per-rank states (above)
        **kw,
    )


# What each rank loads: (rank, every rank's state at step 10, at step 20) -> state(s).
CROSS: dict[str, Callable[[int, list[Any], list[Any]], Any]] = {
    "control": lambda r, a, b: a[r],
    "merged list": lambda r, a, b: a,
    "closed=true on both ranks": lambda r, a, b: seal({**a[r], "closed": True}),
    "different steps (10 and 20)": lambda r, a, b: a[r] if r == 0 else b[r],
    "different base_done on rank 0": lambda r, a, b: (
        seal({**a[0], "base_done": encode(range_ids(a[1]["done"])[:1])}) if r == 0 else a[r]
    ),
    "one emitted id removed from done (rank 0)": lambda r, a, b: (
        seal({**a[0], "done": encode(range_ids(a[0]["done"])[1:])}) if r == 0 else a[r]
    ),
    "one unemitted id added to done (rank 0)": lambda r, a, b: (
        seal({**a[0], "done": encode({*range_ids(a[0]["done"]), *range_ids(b[0]["done"])[-1:]})})
        if r == 0
        else a[r]
    ),
    "step advanced by 5 on both": lambda r, a, b: seal({**a[r], "step": a[r]["step"] + 5}),
    "step and window advanced by 5 on both": lambda r, a, b: seal(
        {**a[r], "step": a[r]["step"] + 5, "window": a[r]["window"] + 5}
    ),
    "epoch differs on rank 0": lambda r, a, b: seal({**a[0], "epoch": 1}) if r == 0 else a[r],
    "ranks swapped their states": lambda r, a, b: a[1 - r],
    "rank 0 holds an id of rank 1": lambda r, a, b: (
        seal({**a[0], "done": encode([*range_ids(a[0]["done"])[1:], range_ids(a[1]["done"])[0]])})
        if r == 0
        else a[r]
    ),
}


def run_cross_cases(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    dl = _gloo_loader()
    it = iter(dl)
    before10 = ids_of(dl, (next(it) for _ in range(10)))
    s10 = json.loads(json.dumps(dl.state_dict()))
    ids_of(dl, (next(it) for _ in range(10)))
    s20 = json.loads(json.dumps(dl.state_dict()))
    del it
    out: dict[str, Any] = {"before10": before10}
    states = _all_states(rank, world, s10, s20)
    for case in spec["cases"]:
        fresh = _gloo_loader()
        res: dict[str, Any] = {}
        try:
            fresh.load_state_dict(CROSS[case](rank, states[0], states[1]))
        except ODBError as exc:
            res["load"] = f"{type(exc).__name__}: {exc}"
        try:
            res["ids"] = ids_of(fresh, fresh)
        except ODBError as exc:
            res["iter"] = f"{type(exc).__name__}: {exc}"
            res["field"] = getattr(exc, "field", None)
            res["ranks"] = list(getattr(exc, "ranks", ()))
            res["step_after"] = fresh.state_dict()["step"]
            res["fresh_ids"] = ids_of(fresh, fresh)  # nothing applied: a fresh epoch
        out[case] = res
    return out


def _all_states(rank: int, world: int, s10: Any, s20: Any) -> tuple[list[Any], list[Any]]:
    import torch.distributed as dist

    got: list[Any] = [None] * world
    dist.all_gather_object(got, (s10, s20))
    return [g[0] for g in got], [g[1] for g in got]


@pytest.fixture(scope="module")
def cross(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from gloo_ranks import launch, ok

    out = tmp_path_factory.mktemp("tamper")
    return ok(launch("test_resume_tamper:run_cross_cases", 2, {"cases": list(CROSS)}, out))


def _ok_exactly_once(res: list[dict[str, Any]], case: str) -> None:
    before = [i for r in res for i in r["before10"]]
    after = [i for r in res for i in r[case]["ids"]]
    assert sorted(before + after) == list(range(CROSS_N)), case


@pytest.mark.parametrize(
    "case", ["control", "merged list", "step and window advanced by 5 on both"]
)
def test_two_ranks_harmless(cross: list[dict[str, Any]], case: str) -> None:
    """Accepted and exactly once (the step shift is harmless: see the single-rank test)."""
    for r in cross:
        assert "load" not in r[case] and "iter" not in r[case], r[case]
    _ok_exactly_once(cross, case)


# case -> what each rank must report: ("load" | "iter", regex, field at iter or None)
REFUSED: dict[str, list[tuple[str, str, str | None]]] = {
    "closed=true on both ranks": [("load", "closed=true but emitted", None)] * 2,
    "different steps (10 and 20)": [("iter", "different step .*rank 0: 10, rank 1: 20", "step")]
    * 2,
    "different base_done on rank 0": [
        ("load", "base_done", None),
        ("iter", r"ranks \[0\] refused theirs", "loaded"),
    ],
    "one emitted id removed from done (rank 0)": [("iter", "missing from done", "done")] * 2,
    "one unemitted id added to done (rank 0)": [("iter", "would be lost", "done")] * 2,
    "step advanced by 5 on both": [("load", "step and window counts disagree", None)] * 2,
    "epoch differs on rank 0": [("iter", "different epoch", "epoch")] * 2,
    "ranks swapped their states": [("load", "belongs to rank", None)] * 2,
    "rank 0 holds an id of rank 1": [
        ("load", "not one of this rank's samples", None),
        ("iter", r"ranks \[0\] refused theirs", "loaded"),
    ],
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_two_ranks_refused_on_every_rank_nothing_applied(
    cross: list[dict[str, Any]], case: str
) -> None:
    for rank, (res, want) in enumerate(zip([r[case] for r in cross], REFUSED[case], strict=True)):
        where, needle, field = want
        assert where in res, (rank, res)
        assert re.search(needle, res[where]), (rank, res[where])
        if "iter" in res:
            if field is not None:
                assert res["field"] == field, (rank, res)
            assert res["step_after"] == 0, "the load was not undone"
    # Refused everywhere, so every rank ran a fresh epoch 0 after (nothing applied).
    fresh = [i for r in cross for i in r[case].get("fresh_ids", r[case].get("ids", []))]
    assert sorted(fresh) == list(range(CROSS_N)), case


class Reversed:
    """id = N - 1 - index: ids that are not the indices, in the same range."""

    def __call__(self, sample: dict[str, Any]) -> int:
        return N - 1 - int(sample["idx"])


class Indexed(Text):
    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**super().__getitem__(i), "idx": i}


def test_resume_with_id_fn_over_own_shards_is_exactly_once() -> None:
    """partition=False with an id_fn: the done ids are id_fn values, not indices, so
    the resumed shard must not be filtered by them as indices (it lost samples)."""

    def make() -> ODBDataLoader:
        return ODBDataLoader(Indexed(N), **{**KW, "id_fn": Reversed(), "partition": False})

    dl = make()
    it = iter(dl)
    before = ids_of(dl, (next(it) for _ in range(4)))
    again = make()
    again.load_state_dict(json.loads(json.dumps(dl.state_dict())))
    assert sorted(before + ids_of(again, again)) == list(range(N))


def _claims(parts: list[Any]) -> list[list[int]]:
    from odb_core.resume import ResumeClaim

    return [ResumeClaim.of(p).to_vector() for p in parts]


def test_check_claims_names_the_field_and_the_odd_rank() -> None:
    """The pure cross-rank decision, at world size 3 (where a majority names the odd
    rank out): field mismatch, a refused load, an id on two ranks, a bad count."""
    from dataclasses import replace

    from odb_core import DuplicateIdError
    from odb_core.resume import EpochProgress, ResumeClaim, check_claims

    parts = [
        EpochProgress({"x": 1}, 0, 4, 6, False, frozenset(), 3, r, frozenset({r, r + 3}))
        for r in range(3)
    ]
    assert check_claims(_claims(parts), 0)  # consistent: a digest of the merged progress
    with pytest.raises(ResumeMismatchError, match=r"different step .*rank 2: 9") as err:
        check_claims(_claims([*parts[:2], replace(parts[2], step=9)]), 0)
    assert (err.value.field, err.value.ranks) == ("step", (2,))
    refused = [*_claims(parts[:2]), ResumeClaim.of(None, refused=True).to_vector()]
    with pytest.raises(ResumeMismatchError, match=r"ranks \[2\] refused") as err:
        check_claims(refused, 1)
    assert (err.value.field, err.value.ranks) == ("loaded", (2,))
    assert check_claims([ResumeClaim.of(None).to_vector()] * 3, 0) == ""  # none loaded
    clash = [*parts[:2], replace(parts[2], done=frozenset({2, 0}))]
    with pytest.raises(DuplicateIdError, match="sample id 0 was done") as dup:
        check_claims(_claims(clash), 0)
    assert dup.value.ranks == (0, 2)
    with pytest.raises(ResumeMismatchError, match="= 5\\) do not account for emitted=6"):
        check_claims(_claims([*parts[:2], replace(parts[2], done=frozenset({2}))]), 0)
