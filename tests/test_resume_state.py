"""The pure resume-state module (`odb_core.resume`), without torch or a loader.

Covers, each with the exact error text, field and ranks a user sees:
the canonical form, checksum and seal of a state; `partition`; fingerprint
diffs; `EpochProgress` (exclusion, shards, `to_dict` / `from_dict` and their
schema checks, `check` and `check_for`); `merge`; `ResumeClaim` and
`check_claims` (the cross-rank check at the first iteration after a load); and
the small helpers with a precise contract (`_outliers`, `_check_count`,
`_digest`, `_packed`, `_hex`, `_show`, `_plain`, `_preview`).
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import re
import sys
from dataclasses import replace
from typing import Any

import pytest

from odb_core.errors import ConfigError, DuplicateIdError, ResumeMismatchError, ResumeStateError
from odb_core.resume import (
    FIELDS,
    SHARED,
    STATE_VERSION,
    EpochProgress,
    ResumeClaim,
    ResumeTarget,
    canonical,
    check_claims,
    checksum,
    fingerprint_mismatch,
    merge,
    partition,
    seal,
)
from odb_core.resume.claims import (
    _CLAIM_FIELDS,
    _check_count,
    _digest,
    _hex,
    _outliers,
    _packed,
    _show,
)
from odb_core.resume.codec import _plain, _preview, read

FP = {"seed": 5, "length": 60}  # not in sorted key order: canonical JSON sorts it
FP_JSON = b'{"length":60,"seed":5}'

# A consistent local state: rank 1 of 2, in a second incarnation of epoch 1.
LOCAL = EpochProgress(
    fingerprint=FP,
    epoch=1,
    step=6,
    emitted=10,
    closed=False,
    base_done=frozenset({0, 1, 2}),
    world_size=2,
    rank=1,
    done=frozenset({3, 5}),
    carry=(),
    window=3,
    start_step=2,
    start_emitted=4,
    start_window=1,
)
# A consistent global (merged) state.
GLOBAL = EpochProgress(
    FP,
    1,
    6,
    3,
    False,
    frozenset({0, 1, 2}),
    window=3,
    start_step=6,
    start_emitted=3,
    start_window=3,
)


def digest_of(raw: bytes) -> int:
    """What `_digest` must give for a value whose canonical JSON is `raw`."""
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big") >> 1


def packed(values: list[int]) -> bytes:
    """What `_packed` must give for integers that fit in 8 bytes."""
    raw = array.array("q", values)
    if sys.byteorder == "big":
        raw.byteswap()
    return b"q" + raw.tobytes()


def stateerr(fn: Any, *args: Any) -> ResumeStateError:
    with pytest.raises(ResumeStateError) as err:
        fn(*args)
    return err.value


def message(fn: Any, *args: Any) -> str:
    return str(stateerr(fn, *args))


def ranks_state(world: int, done: list[set[int]], **kw: Any) -> list[EpochProgress]:
    """Every rank's local state of one step; `emitted` is the total done."""
    emitted = sum(len(d) for d in done) + len(kw.get("base_done", ()))
    fields: dict[str, Any] = {
        "fingerprint": FP,
        "epoch": 0,
        "step": 2,
        "emitted": emitted,
        "closed": False,
        "base_done": frozenset(),
        "start_emitted": len(kw.get("base_done", ())),
        **kw,
    }
    return [
        EpochProgress(world_size=world, rank=r, done=frozenset(done[r]), **fields)
        for r in range(world)
    ]


# ---- canonical form, checksum, seal --------------------------------------------------


def test_canonical_is_sorted_compact_ascii_json_without_the_checksum() -> None:
    state = {"b": 1, "a": [1, "é"], "checksum": "sha256:x", "c": {"z": None, "y": True}}
    assert canonical(state) == b'{"a":[1,"\\u00e9"],"b":1,"c":{"y":true,"z":null}}'


def test_canonical_refuses_a_non_finite_float() -> None:
    with pytest.raises(ValueError, match="not JSON compliant"):
        canonical({"a": float("nan")})


def test_checksum_is_sha256_of_the_canonical_form() -> None:
    want = "sha256:" + hashlib.sha256(b'{"a":1,"b":[2,3]}').hexdigest()
    assert checksum({"b": [2, 3], "a": 1}) == want
    assert checksum({"b": [2, 3], "a": 1, "checksum": "anything"}) == want


def test_seal_returns_a_copy_with_the_checksum_recomputed() -> None:
    state = {"a": 1, "checksum": "sha256:stale"}
    sealed = seal(state)
    assert sealed == {"a": 1, "checksum": "sha256:" + hashlib.sha256(b'{"a":1}').hexdigest()}
    assert state == {"a": 1, "checksum": "sha256:stale"}


# ---- partition, fingerprint_mismatch ------------------------------------------------


def test_partition_is_round_robin() -> None:
    order = [9, 8, 7, 6, 5, 4, 3]
    assert partition(order, 3, 0) == [9, 6, 3]
    assert partition(order, 3, 1) == [8, 5]
    assert partition(order, 3, 2) == [7, 4]
    assert partition(order, 1, 0) == order


@pytest.mark.parametrize(
    ("world", "rank", "text"),
    [
        (3, 3, "rank=3 is not in [0, 3)"),
        (3, -1, "rank=-1 is not in [0, 3)"),
        (0, 0, "rank=0 is not in [0, 0)"),
    ],
)
def test_partition_refuses_a_rank_outside_the_world(world: int, rank: int, text: str) -> None:
    with pytest.raises(ConfigError) as err:
        partition([1, 2, 3], world, rank)
    assert str(err.value) == text


def test_fingerprint_mismatch_lists_every_differing_key_sorted() -> None:
    got = fingerprint_mismatch({"c": 3, "a": 1, "b": "x"}, {"d": 4, "a": 1, "b": "y"})
    assert got == ["b: saved='y' now='x'", "c: saved=None now=3", "d: saved=4 now=None"]
    assert fingerprint_mismatch(FP, dict(FP)) == []


# ---- EpochProgress: exclusion and shards --------------------------------------------


def test_excluded_ids_of_a_local_and_a_global_state() -> None:
    assert not LOCAL.is_global and GLOBAL.is_global
    assert LOCAL.excluded(2, 1) == frozenset({0, 1, 2, 3, 5})
    assert GLOBAL.excluded(5, 4) == frozenset({0, 1, 2})


@pytest.mark.parametrize(("world", "rank"), [(2, 0), (3, 1)])
def test_a_local_state_refuses_another_rank_or_world(world: int, rank: int) -> None:
    assert message(LOCAL.excluded, world, rank) == (
        f"this loader state belongs to rank 1 of world size 2, but it is loaded on rank "
        f"{rank} of world size {world}; to resume at another world size or rank, load the "
        "list of every rank's state_dict() taken at the same step (they are merged with "
        "merge_states)"
    )


def test_shard_splits_the_ids_not_in_base_done_less_the_own_done() -> None:
    order = list(range(12))
    # rest = 3..11; rank 1 of 2 gets 4, 6, 8, 10 in epoch order; 3 and 5 are not its own
    assert LOCAL.shard(order, 2, 1) == [4, 6, 8, 10]
    assert replace(LOCAL, done=frozenset({6})).shard(order, 2, 1) == [4, 8, 10]
    assert GLOBAL.shard(order, 3, 2) == [5, 8, 11]


# ---- to_dict / from_dict ------------------------------------------------------------


def test_to_dict_is_the_sealed_plain_state() -> None:
    state = replace(LOCAL, carry=((12, 11), ()), fingerprint={"b": 1, "a": 2}).to_dict()
    body = {
        "format": "odb_core.epoch_progress",
        "version": 4,
        "fingerprint": {"b": 1, "a": 2},
        "epoch": 1,
        "step": 6,
        "emitted": 10,
        "closed": False,
        "base_done": [[0, 3]],
        "world_size": 2,
        "rank": 1,
        "done": [[3, 4], [5, 6]],
        "carry": [[12, 11], []],
        "window": 3,
        "start_step": 2,
        "start_emitted": 4,
        "start_window": 1,
    }
    assert state == {**body, "checksum": checksum(body)}
    assert list(state) == list(FIELDS)


def test_the_field_list_is_written_once_in_the_record() -> None:
    names = tuple(f.name for f in dataclasses.fields(EpochProgress))
    assert ("format", "version", *names, "checksum") == FIELDS
    # the parse yields every field of the record (none left to its default)
    assert set(read(LOCAL.to_dict())) == set(read(GLOBAL.to_dict())) == set(names)
    assert (
        tuple(n for n in names if n not in ("fingerprint", "world_size", "rank", "done")) == SHARED
    )
    assert _CLAIM_FIELDS[:8] == tuple(n for n in SHARED if n not in ("base_done", "carry"))


@pytest.mark.parametrize(
    "progress",
    [LOCAL, GLOBAL, replace(LOCAL, carry=((12,), (11, 13)), closed=False)],
    ids=["local", "global", "carry"],
)
def test_from_dict_reads_back_what_to_dict_wrote(progress: EpochProgress) -> None:
    back = EpochProgress.from_dict(progress.to_dict())
    assert back == progress
    assert back.fingerprint == FP and type(back.fingerprint) is dict


def test_from_dict_accepts_tuples_finite_floats_and_nested_plain_data() -> None:
    fp = {"lr": 0.5, "name": "x", "opt": None, "on": True, "nest": {"k": [1, 2.5]}}
    state = replace(LOCAL, fingerprint=fp).to_dict()
    state = seal({**state, "base_done": ((0, 3),), "done": ((3, 4), (5, 6)), "carry": ((), ())})
    back = EpochProgress.from_dict(state)
    assert back == replace(LOCAL, fingerprint=fp, carry=((), ()))


def test_from_dict_accepts_rank_zero_of_world_one() -> None:
    state = replace(LOCAL, world_size=1, rank=0).to_dict()
    assert EpochProgress.from_dict(state).rank == 0


def from_dict_error(state: object) -> str:
    return message(EpochProgress.from_dict, state)


def sealed(**fields: Any) -> dict[str, Any]:
    return seal({**LOCAL.to_dict(), **fields})


@pytest.mark.parametrize("state", [[1, 2], {"format": "other"}, {}])
def test_from_dict_refuses_what_is_not_a_state(state: object) -> None:
    assert from_dict_error(state) == (
        f"not an ODBDataLoader state (expected format 'odb_core.epoch_progress'): {state!r}"
    )


def test_from_dict_previews_a_long_non_state() -> None:
    text = from_dict_error(list(range(40)))
    assert text == (
        "not an ODBDataLoader state (expected format 'odb_core.epoch_progress'): "
        + repr(list(range(40)))[:77]
        + "..."
    )


OLDER = (
    ": it was saved by an older odb-core (version 3 lists done ids one by one, older ones "
    "carry no checksum or no optimizer windows) and cannot be resumed by this one (restart "
    "the epoch, or resume with the odb-core that saved it)"
)


@pytest.mark.parametrize(
    ("version", "text"),
    [
        (3, "loader state version 3, expected 4" + OLDER),
        (2, "loader state version 2, expected 4" + OLDER),
        (0, "loader state version 0, expected 4" + OLDER),
        (5, "loader state version 5, expected 4"),
        ("4", "loader state version '4', expected 4"),
        (3.5, "loader state version 3.5, expected 4"),
        (True, "loader state version True, expected 4" + OLDER),
        (None, "loader state version None, expected 4"),
    ],
)
def test_from_dict_refuses_another_version(version: object, text: str) -> None:
    assert STATE_VERSION == 4
    assert from_dict_error(sealed(version=version)) == text


def test_from_dict_refuses_a_state_without_checksum() -> None:
    state = {k: v for k, v in LOCAL.to_dict().items() if k != "checksum"}
    assert from_dict_error(state) == (
        "loader state has no checksum field: it was not written by state_dict() (or the "
        "field was stripped), so its content cannot be trusted"
    )


def test_from_dict_names_the_missing_fields_in_schema_order() -> None:
    state = {k: v for k, v in LOCAL.to_dict().items() if k not in ("window", "epoch")}
    assert from_dict_error(state) == "loader state is missing the fields 'epoch', 'window'"
    one = {k: v for k, v in LOCAL.to_dict().items() if k != "rank"}
    assert from_dict_error(one) == "loader state is missing the field 'rank'"


def test_from_dict_names_the_unknown_fields_sorted_by_repr() -> None:
    state = {**LOCAL.to_dict(), "zz": 1, 7: 2, "aa": 3}
    assert from_dict_error(state) == (
        "loader state has unknown field(s) 'aa', 'zz', 7: not a state of version 4"
    )


@pytest.mark.parametrize(
    ("fields", "text"),
    [
        ({"done": [[3, 4], {5}]}, "loader state field done[1] holds a set ({5}), not plain"),
        ({"step": b"6"}, "loader state field step holds a bytes (b'6'), not plain data"),
        ({"fingerprint": {"a": [1.5, float("inf")]}}, "loader state field fingerprint.a[1]=inf"),
        ({"checksum": float("nan")}, "loader state field checksum=nan is not a finite number"),
        ({"fingerprint": {"a": {1: 2}}}, "loader state field fingerprint.a has the non-string"),
        ({"carry": ([1], (2, -0.5, object))}, "loader state field carry[1][2] holds a type ("),
    ],
)
def test_from_dict_refuses_data_that_is_not_plain(fields: dict[str, Any], text: str) -> None:
    assert from_dict_error({**LOCAL.to_dict(), **fields}).startswith(text)


def test_plain_error_texts() -> None:
    assert message(_plain, {1, 2}, "x") == (
        "loader state field x holds a set ({1, 2}), not plain data (JSON types: dict, "
        "list, str, int, float, bool, None)"
    )
    assert message(_plain, [0, (1, -float("inf"))], "p") == (
        "loader state field p[1][1]=-inf is not a finite number"
    )
    assert message(_plain, {"a": {"b": [{2: 1}]}}, "f") == (
        "loader state field f.a.b[0] has the non-string key 2"
    )
    assert message(_plain, {"a": float("nan")}, "f") == (
        "loader state field f.a=nan is not a finite number"
    )
    for ok in (None, True, 0, -3, "s", 1.25, [1, [None]], (2,), {"k": {"j": [0.5]}}):
        assert _plain(ok, "x") is None


@pytest.mark.parametrize(
    ("saved", "text"),
    [
        (5, "loader state checksum 5 is not sha256:<hex>"),
        (None, "loader state checksum None is not sha256:<hex>"),
        ("md5:abc", "loader state checksum 'md5:abc' is not sha256:<hex>"),
    ],
)
def test_from_dict_refuses_a_checksum_of_another_form(saved: object, text: str) -> None:
    assert from_dict_error({**LOCAL.to_dict(), "checksum": saved}) == text


def test_from_dict_refuses_content_that_does_not_match_its_checksum() -> None:
    state = LOCAL.to_dict()
    edited = {**state, "emitted": 11}
    assert from_dict_error(edited) == (
        f"loader state checksum mismatch: it records {state['checksum'][:23]}... but its "
        f"content hashes to {checksum(edited)[:23]}...: the state changed after "
        "state_dict() wrote it (storage corruption, or an edit)"
    )


@pytest.mark.parametrize(
    ("fields", "text"),
    [
        ({"fingerprint": [1]}, "loader state field fingerprint=[1] must be a mapping"),
        ({"fingerprint": "x"}, "loader state field fingerprint='x' must be a mapping"),
        ({"closed": 1}, "loader state field closed=1 must be a bool"),
        ({"closed": None}, "loader state field closed=None must be a bool"),
        (
            {"rank": None},
            "loader state has world_size=2 and rank=None: both must be set (one rank's "
            "state) or both null (a merged state)",
        ),
        (
            {"world_size": None},
            "loader state has world_size=None and rank=1: both must be set (one rank's "
            "state) or both null (a merged state)",
        ),
        ({"rank": 2}, "loader state field rank=2 is not in [0, world_size=2)"),
        ({"world_size": 0, "rank": 0}, "loader state field rank=0 is not in [0, world_size=0)"),
        ({"rank": -1}, "loader state field rank=-1 must be a non-negative integer"),
        ({"world_size": True}, "loader state field world_size=True must be a non-negative integer"),
        ({"carry": [[1, 1]]}, "loader state field carry: sample id 1 is in the ledger twice"),
        ({"carry": "ab"}, "loader state field carry: ledgers must be a sequence of per-rank id"),
        ({"epoch": -1}, "loader state field epoch=-1 must be a non-negative integer"),
        ({"step": True}, "loader state field step=True must be a non-negative integer"),
        ({"emitted": 1.0}, "loader state field emitted=1.0 must be a non-negative integer"),
        ({"window": "3"}, "loader state field window='3' must be a non-negative integer"),
        ({"start_step": None}, "loader state field start_step=None must be a non-negative"),
        ({"start_emitted": -4}, "loader state field start_emitted=-4 must be a non-negative"),
        ({"start_window": False}, "loader state field start_window=False must be a non-negative"),
        ({"base_done": "012"}, "loader state field base_done must be a list of [start, stop]"),
        ({"base_done": {"0": 1}}, "loader state field base_done must be a list of [start, st"),
        ({"done": [3, 5]}, "loader state field done[0]=3 is not a [start, stop] pair of int"),
        ({"done": [[3, True]]}, "loader state field done[0]=[3, True] is not a [start, stop]"),
        ({"done": [[3, 5.0]]}, "loader state field done[0]=[3, 5.0] is not a [start, stop]"),
        ({"done": [[3, 4, 5]]}, "loader state field done[0]=[3, 4, 5] is not a [start, stop]"),
        ({"done": [[5, 5]]}, "loader state field done[0]=[5, 5] is not a range start < stop"),
        ({"done": [[2, 1]]}, "loader state field done[0]=[2, 1] is not a range start < stop"),
        ({"done": [[3, 6], [5, 8]]}, "loader state field done[1]=[5, 8] overlaps, touches or"),
        ({"done": [[3, 5], [5, 8]]}, "loader state field done[1]=[5, 8] overlaps, touches or"),
        ({"done": [[7, 8], [3, 4]]}, "loader state field done[1]=[3, 4] overlaps, touches or"),
        ({"emitted": 7}, "loader state has 4 steps since step 2 but only 3 samples emitted"),
    ],
)
def test_from_dict_refuses_a_sealed_state_with_a_bad_field(
    fields: dict[str, Any], text: str
) -> None:
    got = from_dict_error(sealed(**fields))
    assert got.startswith(text), got
    if text.endswith(("twice", "ids", "bool", "mapping", "=2)", "=0)", "integer")):
        assert got == text


def test_from_dict_names_the_first_bad_integer_field() -> None:
    got = from_dict_error(sealed(epoch="e", step="s", window="w"))
    assert got == "loader state field epoch='e' must be a non-negative integer"


def test_from_dict_checks_the_fields_against_each_other() -> None:
    state = sealed(done=[[2, 4]])
    assert from_dict_error(state) == (
        "loader state: id 2 is in both base_done and done (1 such ids)"
    )


# ---- EpochProgress.check ------------------------------------------------------------


def test_check_accepts_consistent_states_and_their_boundaries() -> None:
    for ok in (
        LOCAL,
        GLOBAL,
        replace(LOCAL, start_step=6, start_emitted=10),  # a run that has not stepped
        replace(LOCAL, start_window=2),  # start_window == start_step
        replace(LOCAL, window=6),  # window == step
        replace(LOCAL, emitted=8),  # one sample per step since start_step
        replace(LOCAL, start_emitted=3),  # base_done == start_emitted
        replace(LOCAL, done=frozenset({3, 4, 5, 6, 7, 8, 9})),  # every emitted id done
        EpochProgress(FP, 0, 0, 0, False, frozenset()),
    ):
        assert ok.check() is None


@pytest.mark.parametrize(
    ("fields", "lo", "hi"),
    [
        ({"start_step": 7}, "start_step=7", "step=6"),
        ({"start_emitted": 11}, "start_emitted=11", "emitted=10"),
        ({"start_window": 4}, "start_window=4", "window=3"),
        ({"start_window": 3}, "start_window=3", "start_step=2"),
        ({"window": 7}, "window=7", "step=6"),
    ],
)
def test_check_refuses_a_run_that_ends_before_it_starts(
    fields: dict[str, int], lo: str, hi: str
) -> None:
    assert message(replace(LOCAL, **fields).check) == (
        f"loader state has {lo} > {hi}: impossible in a state the loader wrote (a run "
        "starts before it ends, and a window holds at least one step)"
    )


def test_check_refuses_an_id_in_base_done_and_done() -> None:
    state = replace(LOCAL, base_done=frozenset({0, 4, 3}), done=frozenset({5, 4, 3}))
    assert message(state.check) == "loader state: id 3 is in both base_done and done (2 such ids)"


def test_check_refuses_fewer_samples_than_steps() -> None:
    assert message(replace(LOCAL, emitted=7).check) == (
        "loader state has 4 steps since step 2 but only 3 samples emitted in them: every "
        "step emits at least one sample"
    )


def test_check_refuses_more_base_done_than_emitted_before_the_run() -> None:
    assert message(replace(LOCAL, start_emitted=2).check) == (
        "loader state has 3 base_done ids but only start_emitted=2 samples were emitted "
        "before this run"
    )


def test_check_refuses_more_ids_done_than_emitted() -> None:
    state = replace(LOCAL, emitted=8, done=frozenset({3, 4, 5, 6, 7, 8}))
    assert message(state.check) == (
        "loader state marks 9 ids done but emitted=8: ids never emitted are marked done "
        "(they would be lost)"
    )


MERGED_TEXT = (
    "loader state is a merged (all-rank) state but its fields are not those merge_states "
    "writes: done must be empty, start_step/start_emitted/start_window equal to "
    "step/emitted/window, and base_done hold exactly emitted={} ids (it holds {})"
)


@pytest.mark.parametrize(
    ("fields", "emitted"),
    [
        ({"start_window": 2}, 3),  # start_window is not window
        ({"step": 7, "emitted": 4}, 4),  # a run since step 6
        ({"emitted": 4, "start_emitted": 4}, 4),  # base_done short of emitted
        ({"emitted": 4, "start_emitted": 4, "done": frozenset({7})}, 4),
    ],
)
def test_check_refuses_a_global_state_merge_does_not_write(
    fields: dict[str, Any], emitted: int
) -> None:
    assert message(replace(GLOBAL, **fields).check) == MERGED_TEXT.format(emitted, 3)


# ---- EpochProgress.check_for --------------------------------------------------------


def test_check_for_accepts_the_loader_it_belongs_to() -> None:
    order = list(range(12))
    target = ResumeTarget(2, 1, id_limit=12, order=order, size=10, steps_per_window=2)
    assert LOCAL.check_for(replace(target, order=None)) is None
    # a local state with done ids: the check's pass yields this rank's shard
    # (base_done 0..2 out, ids 4, 6, 8, 10 on rank 1 of 2, 4 and 6 done)
    local = replace(LOCAL, done=frozenset({4, 6}))
    assert local.check_for(target) == local.shard(order, 2, 1) == [8, 10]
    assert GLOBAL.check_for(ResumeTarget(5, 4, id_limit=3, order=order, size=3)) is None
    # a global state never splits the order itself, whatever the target's rank
    assert GLOBAL.check_for(ResumeTarget(2, 7, order=order)) is None


def test_check_for_refuses_another_rank() -> None:
    assert message(LOCAL.check_for, ResumeTarget(2, 0)).startswith(
        "this loader state belongs to rank 1 of world size 2, but it is loaded on rank 0"
    )


WINDOWS = (
    "loader state has step={} (run from step {}) but window={} (from {}): with {} step(s) "
    "per optimizer window the step and window counts disagree"
)


@pytest.mark.parametrize(
    ("fields", "g", "shown"),
    [
        ({}, 1, (6, 2, 3, 1, 1)),  # start_step 2 > start_window 1 * 1
        ({"step": 7}, 2, (7, 2, 3, 1, 2)),  # 5 steps in 2 windows of 2
        ({"start_window": 2, "start_step": 5, "window": 2}, 2, (6, 5, 2, 2, 2)),
    ],
)
def test_check_for_refuses_steps_and_windows_that_disagree(
    fields: dict[str, int], g: int, shown: tuple[int, ...]
) -> None:
    state = replace(LOCAL, **fields)
    target = ResumeTarget(2, 1, steps_per_window=g)
    assert message(state.check_for, target) == WINDOWS.format(*shown)


def test_check_for_accepts_steps_and_windows_at_the_limit() -> None:
    # start_step 4 == start_window 2 * 2 (a mutant dividing would refuse it)
    state = replace(LOCAL, start_step=4, start_window=2, window=3, step=6, start_emitted=4)
    assert state.check_for(ResumeTarget(2, 1, steps_per_window=2)) is None
    # 6 steps since start_step 2 in windows 3..1 of 3 steps: (3 - 1) * 3 == 6
    wide = replace(LOCAL, step=8, start_step=2, window=3, start_window=1, emitted=12)
    assert wide.check_for(ResumeTarget(2, 1, steps_per_window=3)) is None
    # with start_window 2: (3 - 2) * 3 == 3 steps since start_step 6, no more
    late = replace(wide, start_step=6, start_window=2, start_emitted=6, step=9)
    assert late.check_for(ResumeTarget(2, 1, steps_per_window=3)) is None
    assert message(replace(late, step=10).check_for, ResumeTarget(2, 1, steps_per_window=3))


@pytest.mark.parametrize(
    ("fields", "limit", "name", "bad"),
    [
        ({}, 5, "done", 5),
        ({"base_done": frozenset({-1, 0, 9})}, 12, "base_done", -1),
        ({"base_done": frozenset({0, 1, 12})}, 12, "base_done", 12),
        ({"done": frozenset({-2, 3, 20})}, 12, "done", -2),
        ({"carry": ((7,), (2,))}, 7, "carry", 7),
        ({"carry": ((), (-3, 1))}, 7, "carry", -3),
    ],
)
def test_check_for_refuses_an_id_outside_the_dataset(
    fields: dict[str, Any], limit: int, name: str, bad: int
) -> None:
    state = replace(LOCAL, **fields)
    assert message(state.check_for, ResumeTarget(2, 1, id_limit=limit)) == (
        f"loader state field {name} holds id {bad}, which is not an index of this dataset "
        f"(0..{limit - 1})"
    )


def test_check_for_accepts_empty_id_sets_with_an_id_limit() -> None:
    empty = EpochProgress(FP, 0, 0, 0, False, frozenset(), 2, 1)
    assert empty.check_for(ResumeTarget(2, 1, id_limit=1)) is None
    assert LOCAL.check_for(ResumeTarget(2, 1, id_limit=6)) is None


FOREIGN = (
    "loader state of rank 1: done id {} is not one of this rank's samples in this part "
    "of the epoch ({} such ids)"
)


def test_check_for_refuses_done_ids_of_another_rank() -> None:
    order = list(range(12))
    target = ResumeTarget(2, 1, order=order)
    # rest after base_done {0, 1, 2} is 3..11: rank 1 holds 4, 6, 8, 10
    assert message(LOCAL.check_for, target) == FOREIGN.format(3, 2)
    assert message(replace(LOCAL, done=frozenset({4, 7})).check_for, target) == FOREIGN.format(7, 1)
    # no base_done: rank 1 holds the odd ids
    fresh = replace(LOCAL, base_done=frozenset(), start_emitted=0)
    assert replace(fresh, done=frozenset({1, 3})).check_for(target) == [5, 7, 9, 11]
    assert message(replace(fresh, done=frozenset({2})).check_for, target) == FOREIGN.format(2, 1)


def test_check_for_counts_the_carried_share_of_the_rank_as_its_own() -> None:
    order = list(range(12))
    target = ResumeTarget(2, 1, join=False, order=order)
    # the ledger less base_done deals (6, 3): rank 1 gets 3 first, then 4, 8, 10
    carry = ((0, 6), (3,))
    state = replace(LOCAL, done=frozenset({3, 4}), carry=carry)
    assert state.check_for(target) is None
    assert message(replace(state, done=frozenset({4, 6})).check_for, target) == FOREIGN.format(6, 1)


@pytest.mark.parametrize(
    ("fields", "join", "size", "text"),
    [
        ({}, True, 9, "loader state has emitted=10 but the epoch has 9 samples"),
        (
            {"closed": True, "carry": ((11,), (12,))},
            False,
            11,
            "loader state has emitted=10 and 2 carried but the epoch has 11 samples",
        ),
        (
            {"closed": True, "carry": ((11,), (12,))},
            False,
            13,
            "loader state is closed=true but emitted=10 + 2 carried of the epoch's 13 "
            "samples: an epoch closes only once every sample is emitted or carried (1 would "
            "be lost)",
        ),
        (
            {"closed": True, "carry": ((11,), (12,))},
            True,
            12,
            "loader state is closed=true but emitted=10 of the epoch's 12 samples: an epoch "
            "closes only once every sample is emitted (2 would be lost)",
        ),
        (
            {"closed": True},
            False,
            11,
            "loader state is closed=true but emitted=10 of the epoch's 11 samples: an epoch "
            "closes only once every sample is emitted or carried (1 would be lost)",
        ),
    ],
)
def test_check_for_refuses_counts_beyond_the_epoch(
    fields: dict[str, Any], join: bool, size: int, text: str
) -> None:
    state = replace(LOCAL, **fields)
    assert message(state.check_for, ResumeTarget(2, 1, join=join, size=size)) == text


def test_check_for_accepts_counts_within_the_epoch() -> None:
    carry = ((11,), (12,))
    for fields, join, size in (
        ({}, True, 10),
        ({}, True, 11),
        ({"carry": carry}, False, 10),  # an open epoch's carry is its plan, not its ledger
        ({"closed": True}, True, 10),
        ({"closed": True, "carry": carry}, False, 12),
        ({"closed": True, "carry": carry}, True, 10),
    ):
        assert replace(LOCAL, **fields).check_for(ResumeTarget(2, 1, join=join, size=size)) is None


# ---- merge --------------------------------------------------------------------------


def test_merge_unions_the_done_ids_into_a_new_run_at_the_saved_step() -> None:
    parts = ranks_state(
        3,
        [{3, 4}, {5}, {6, 7, 8}],
        base_done=frozenset({0, 1, 2}),
        carry=((9,), ()),
        window=1,
        start_step=1,
        start_window=1,
        step=3,
    )
    merged = merge(reversed(parts))
    assert merged == EpochProgress(
        FP,
        0,
        3,
        9,
        False,
        frozenset(range(9)),
        carry=((9,), ()),
        window=1,
        start_step=3,
        start_emitted=9,
        start_window=1,
    )
    assert merged.check() is None


def test_merge_of_one_rank_and_of_a_merged_state() -> None:
    (only,) = ranks_state(1, [{0, 1}])
    assert merge([only]) == EpochProgress(
        FP, 0, 2, 2, False, frozenset({0, 1}), start_step=2, start_emitted=2
    )
    assert merge([GLOBAL]) is GLOBAL
    assert merge(iter([GLOBAL])) is GLOBAL


def test_merge_refuses_no_states() -> None:
    assert message(merge, []) == "merge needs the state of every rank, got none"


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_merge_refuses_a_merged_state_among_per_rank_states(order: tuple[int, int]) -> None:
    (local,) = ranks_state(1, [{0, 1, 2}])
    given = [[GLOBAL, local][i] for i in order]
    err = stateerr(merge, given)
    assert type(err) is ResumeStateError
    assert str(err) == "cannot merge a merged (global) loader state with per-rank states"
    assert message(merge, [GLOBAL, GLOBAL]) == str(err)


def test_merge_sorts_the_states_by_rank() -> None:
    parts = ranks_state(3, [{0}, {1}, {2}])
    for given in ([parts[2], parts[0], parts[1]], [parts[1], parts[2], parts[0]]):
        assert merge(given).base_done == frozenset({0, 1, 2})


@pytest.mark.parametrize(
    ("ranks", "worlds", "shown"),
    [
        ([0, 2], [3, 3], "got ranks [0, 2] for world sizes [3]"),
        ([0, 0], [2, 2], "got ranks [0, 0] for world sizes [2]"),
        ([0, 1], [2, 3], "got ranks [0, 1] for world sizes [2, 3]"),
        ([0, 1], [10, 9], "got ranks [0, 1] for world sizes [10, 9]"),
        ([0, 1], [2, None], "got ranks [0, 1] for world sizes [2, None]"),
        ([0], [None], "got ranks [0] for world sizes [None]"),
        ([1], [2], "got ranks [1] for world sizes [2]"),
    ],
)
def test_merge_refuses_anything_but_one_state_per_rank_of_one_world(
    ranks: list[int], worlds: list[int | None], shown: str
) -> None:
    parts = [
        EpochProgress(FP, 0, 1, 1, False, frozenset(), world_size=w, rank=r, done=frozenset())
        for r, w in zip(ranks, worlds, strict=True)
    ]
    err = stateerr(merge, parts)
    assert type(err) is ResumeStateError
    assert str(err) == f"merge needs exactly one state per rank of one run; {shown}"


def test_merge_refuses_a_rank_of_another_config() -> None:
    parts = ranks_state(3, [{0}, {1}, {2}])
    parts[2] = replace(parts[2], fingerprint={"seed": 6, "length": 60, "x": 1})
    err = stateerr(merge, parts)
    assert type(err) is ResumeStateError
    assert str(err) == (
        "rank 2 state is from another config: seed: saved=6 now=5; x: saved=1 now=None"
    )


@pytest.mark.parametrize("name", SHARED)
def test_merge_refuses_ranks_at_different_steps_naming_the_field(name: str) -> None:
    parts = ranks_state(3, [{0}, {1}, {2}])
    first = getattr(parts[0], name)
    other = {
        bool: lambda v: not v,
        int: lambda v: v + 1,
        frozenset: lambda v: v | {99},
        tuple: lambda v: ((99,),),
    }[type(first)](first)
    parts[1] = replace(parts[1], **{name: other})
    with pytest.raises(ResumeMismatchError) as err:
        merge(parts)
    assert str(err.value) == (
        f"rank 1 state has {name}={_preview(other)} but rank 0 has {_preview(first)}: "
        "states must be taken at the same step of the same epoch"
    )
    assert (err.value.field, err.value.ranks) == (name, (0, 1))


def test_merge_names_the_last_differing_rank_with_a_long_preview() -> None:
    parts = ranks_state(3, [{0}, {1}, {2}], base_done=frozenset(range(100, 130)))
    parts[2] = replace(parts[2], base_done=frozenset(range(200, 230)))
    with pytest.raises(ResumeMismatchError) as err:
        merge(parts)
    shown = repr(frozenset(range(200, 230)))[:77] + "..."
    first = repr(frozenset(range(100, 130)))[:77] + "..."
    assert str(err.value) == (
        f"rank 2 state has base_done={shown} but rank 0 has {first}: states must be taken "
        "at the same step of the same epoch"
    )
    assert (err.value.field, err.value.ranks) == ("base_done", (0, 2))


def test_merge_refuses_an_id_done_on_two_ranks() -> None:
    clash = set(range(20, 32))
    parts = ranks_state(2, [clash | {1}, clash | {2}])
    err = stateerr(merge, parts)
    assert type(err) is ResumeStateError
    assert str(err) == (f"ids {list(range(20, 30))} are done on two ranks; states corrupt")
    based = ranks_state(2, [{5}, {6}], base_done=frozenset({5}))
    assert message(merge, based) == "ids [5] are done on two ranks; states corrupt"


@pytest.mark.parametrize(
    ("emitted", "effect"),
    [
        (7, "1 emitted samples are missing from done and would be emitted again"),
        (5, "1 ids never emitted are marked done and would be lost"),
    ],
)
def test_merge_refuses_done_ids_that_do_not_add_up(emitted: int, effect: str) -> None:
    parts = ranks_state(3, [{3}, {4, 5}, set()], base_done=frozenset({0, 1, 2}), emitted=emitted)
    with pytest.raises(ResumeMismatchError) as err:
        merge(parts)
    assert str(err.value) == (
        "the states' done ids (base_done 3 + rank 0: 1 + rank 1: 2 + rank 2: 0 = 6) do not "
        f"account for emitted={emitted}: {effect}; nothing was applied"
    )
    assert (err.value.field, err.value.ranks) == ("done", (0, 1, 2))


# ---- _check_count, _outliers ----------------------------------------------------------


def test_check_count_accepts_an_exact_count() -> None:
    assert _check_count(5, 2, [(0, 1), (1, 2)]) is None
    assert _check_count(0, 0, []) is None


def test_check_count_names_the_shortfall_and_the_excess() -> None:
    with pytest.raises(ResumeMismatchError) as err:
        _check_count(9, 2, [(0, 1), (3, 2)])
    assert str(err.value) == (
        "the states' done ids (base_done 2 + rank 0: 1 + rank 3: 2 = 5) do not account for "
        "emitted=9: 4 emitted samples are missing from done and would be emitted again; "
        "nothing was applied"
    )
    assert (err.value.field, err.value.ranks) == ("done", (0, 3))
    with pytest.raises(ResumeMismatchError) as err:
        _check_count(1, 0, [(4, 3)])
    assert str(err.value) == (
        "the states' done ids (base_done 0 + rank 4: 3 = 3) do not account for emitted=1: "
        "2 ids never emitted are marked done and would be lost; nothing was applied"
    )
    assert (err.value.field, err.value.ranks) == ("done", (4,))


@pytest.mark.parametrize(
    ("values", "ranks"),
    [
        ([1, 1, 2], (2,)),
        ([2, 1, 1, 1], (0,)),
        ([3, 3], ()),
        (["a"], ()),
        ([1, 2], (0, 1)),
        ([1, 1, 2, 2, 3], (0, 1, 2, 3, 4)),
        ([1, 2, 3], (0, 1, 2)),
        ([1, 1, 1, 2, 3], (3, 4)),
    ],
)
def test_outliers_are_the_ranks_off_the_majority_or_all_on_a_tie(
    values: list[object], ranks: tuple[int, ...]
) -> None:
    assert _outliers(values) == ranks


# ---- ResumeClaim ----------------------------------------------------------------------


def test_claim_of_nothing_and_of_a_refused_state() -> None:
    assert ResumeClaim.of(None) == ResumeClaim(0, (), ())
    assert ResumeClaim.of(None, refused=True) == ResumeClaim(2, (), ())
    assert ResumeClaim.of(None).to_vector() == [0x0DB5, 0, 0]
    assert ResumeClaim.of(None, refused=True).to_vector() == [0x0DB5, 2, 0]


def test_claim_of_a_local_state_holds_the_shared_fields_and_the_done_ids() -> None:
    state = replace(LOCAL, carry=((12,), (11, 13)), closed=True)
    claim = ResumeClaim.of(state)
    shared = (1, 6, 10, 1, 3, 2, 4, 1, 0, 2, 3)
    ids = digest_of(packed([0, 1, 2]))
    digests = (ids, digest_of(b"[[12],[11,13]]"), digest_of(FP_JSON))
    assert claim == ResumeClaim(1, shared + digests, (3, 5))
    assert claim.to_vector() == [0x0DB5, 1, 14, *shared, *digests, 3, 5]


def test_claim_of_a_global_state() -> None:
    claim = ResumeClaim.of(GLOBAL)
    digests = (digest_of(packed([0, 1, 2])), digest_of(b"[]"), digest_of(FP_JSON))
    assert claim == ResumeClaim(1, (1, 6, 3, 0, 3, 6, 3, 3, 1, -1, 3, *digests), ())


def test_claim_field_reads_each_shared_field_by_name() -> None:
    claim = ResumeClaim(1, tuple(range(100, 114)), (7,))
    want = {name: 100 + i for i, name in enumerate(_CLAIM_FIELDS[:10])}
    want |= {"base_done": (110, 111), "carry": 112, "fingerprint": 113}
    assert {name: claim.field(name) for name in _CLAIM_FIELDS} == want


def test_claim_vector_round_trip() -> None:
    claim = ResumeClaim.of(LOCAL)
    assert ResumeClaim.from_vector(claim.to_vector(), 3) == claim
    assert ResumeClaim.from_vector([0x0DB5, 0, 0], 0) == ResumeClaim(0)
    assert ResumeClaim.from_vector([0x0DB5, 1, 2, 8, 9], 0) == ResumeClaim(1, (8, 9), ())
    assert ResumeClaim.from_vector((0x0DB5, 1, 1, 8, 9, 4), 0) == ResumeClaim(1, (8,), (9, 4))


@pytest.mark.parametrize(
    "vector", [[], [0x0DB5, 1], [0x0DB4, 1, 0], [0x0DB5, 1, 2, 8], [1, 0x0DB5, 0]]
)
def test_claim_refuses_a_malformed_vector(vector: list[int]) -> None:
    with pytest.raises(ResumeMismatchError) as err:
        ResumeClaim.from_vector(vector, 2)
    assert str(err.value) == f"rank 2 sent a malformed resume claim {vector!r}"
    assert (err.value.field, err.value.ranks) == ("claim", (2,))


def test_claim_preview_of_a_long_malformed_vector() -> None:
    vector = [0x0DB5, 1, 99, *range(40)]
    with pytest.raises(ResumeMismatchError) as err:
        ResumeClaim.from_vector(tuple(vector), 0)
    assert str(err.value) == f"rank 0 sent a malformed resume claim {repr(vector)[:77]}..."


# ---- check_claims ---------------------------------------------------------------------


def three() -> list[EpochProgress]:
    return ranks_state(3, [{0, 3}, {1, 4}, {2, 5}], step=4, window=2)


def vectors(parts: list[EpochProgress | None]) -> list[list[int]]:
    return [ResumeClaim.of(p).to_vector() for p in parts]


def test_check_claims_names_the_rank_of_a_malformed_claim() -> None:
    good = vectors(three()[:1])[0]
    with pytest.raises(ResumeMismatchError) as err:
        check_claims([good, [0x0DB5, 1, 5, 1]], 0)
    assert str(err.value) == "rank 1 sent a malformed resume claim [3509, 1, 5, 1]"
    assert (err.value.field, err.value.ranks) == ("claim", (1,))


def test_check_claims_returns_the_digest_of_the_merged_progress() -> None:
    parts = three()
    got = check_claims(vectors(parts), 1)
    shared = ResumeClaim.of(parts[0]).shared
    raw = packed([*shared, -1, 0, 1, 2, 3, 4, 5])
    assert got == hashlib.sha256(raw).hexdigest()[:16]
    assert check_claims(vectors(parts), 0) == got
    (only,) = ranks_state(1, [{2, 9}])
    raw = packed([*ResumeClaim.of(only).shared, -1, 2, 9])
    assert check_claims(vectors([only]), 0) == hashlib.sha256(raw).hexdigest()[:16]


def test_packed_is_eight_byte_integers_or_text_when_one_does_not_fit() -> None:
    assert _packed([1, -2]) == b"q" + (1).to_bytes(8, "little") + (-2).to_bytes(
        8, "little", signed=True
    )
    assert _packed([1, 2**63]) == b"t1,9223372036854775808"
    assert _packed([]) == b"q"


def test_check_claims_of_no_loaded_state_is_empty() -> None:
    assert check_claims(vectors([None, None]), 1) == ""
    refused = [ResumeClaim.of(None, refused=True).to_vector()] * 2
    assert check_claims(refused, 0) == ""


def test_check_claims_names_the_ranks_that_did_not_load() -> None:
    refused = ResumeClaim.of(None, refused=True).to_vector()
    claims = [vectors(three()[:1])[0], vectors([None])[0], refused]
    with pytest.raises(ResumeMismatchError) as err:
        check_claims(claims, 2)
    assert str(err.value) == (
        "rank 2: the ranks did not all resume: ranks [1] loaded none (or set_epoch discarded "
        "it); ranks [0] loaded a state; ranks [2] refused theirs in load_state_dict. Every "
        "rank must load its state of the same step before iterating"
    )
    assert (err.value.field, err.value.ranks) == ("loaded", (1, 2))


def test_check_claims_shows_an_unknown_status_as_its_number() -> None:
    claims = [[0x0DB5, 7, 0], [0x0DB5, 0, 0], [0x0DB5, 7, 0]]
    with pytest.raises(ResumeMismatchError) as err:
        check_claims(claims, 0)
    assert str(err.value) == (
        "rank 0: the ranks did not all resume: ranks [1] loaded none (or set_epoch discarded "
        "it); ranks [0, 2] 7. Every rank must load its state of the same step before iterating"
    )
    assert (err.value.field, err.value.ranks) == ("loaded", (1, 0, 2))


def mismatch(parts: list[EpochProgress], rank: int = 0) -> ResumeMismatchError:
    with pytest.raises(ResumeMismatchError) as err:
        check_claims(vectors(list(parts)), rank)
    return err.value


def field_text(rank: int, name: str, shown: str) -> str:
    return (
        f"rank {rank}: the ranks loaded states with different {name} ({shown}): every rank "
        "must load its own state taken at the same step of the same run; nothing was applied"
    )


def test_check_claims_names_a_differing_field_and_the_odd_rank() -> None:
    parts = three()
    err = mismatch([*parts[:2], replace(parts[2], step=9)], 1)
    assert str(err) == field_text(1, "step", "rank 0: 4, rank 1: 4, rank 2: 9")
    assert (err.field, err.ranks) == ("step", (2,))
    err = mismatch([replace(parts[0], closed=True), *parts[1:]])
    assert str(err) == field_text(0, "closed", "rank 0: 1, rank 1: 0, rank 2: 0")
    assert (err.field, err.ranks) == ("closed", (0,))


def test_check_claims_names_every_rank_on_a_tie() -> None:
    a, b = ranks_state(2, [{0}, {1}], epoch=3)
    err = mismatch([a, replace(b, epoch=4)])
    assert str(err) == field_text(0, "epoch", "rank 0: 3, rank 1: 4")
    assert (err.field, err.ranks) == ("epoch", (0, 1))


def test_check_claims_names_a_merged_state_among_local_ones() -> None:
    a, b = ranks_state(2, [{0}, {1}])
    merged = replace(b, world_size=None, rank=None)
    err = mismatch([a, merged])
    assert str(err) == field_text(0, "merged", "rank 0: 0, rank 1: 1")
    assert err.field == "merged"


def test_check_claims_shows_differing_id_sets_and_configs_as_digests() -> None:
    parts = three()
    other = replace(parts[1], base_done=frozenset({7}), emitted=7, start_emitted=1)
    err = mismatch([parts[0], other, parts[2]])
    d0, d1 = digest_of(packed([])), digest_of(packed([7]))
    assert str(err) == field_text(0, "emitted", "rank 0: 6, rank 1: 7, rank 2: 6")
    other = replace(parts[1], base_done=frozenset({7}))
    err = mismatch([parts[0], other, parts[2]])
    shown = f"rank 0: 0 ids (digest {d0:016x}), rank 1: 1 ids (digest {d1:016x}), "
    shown += f"rank 2: 0 ids (digest {d0:016x})"
    assert str(err) == field_text(0, "base_done", shown)
    assert (err.field, err.ranks) == ("base_done", (1,))
    c0, c1 = digest_of(b"[]"), digest_of(b"[[8]]")
    err = mismatch([*parts[:2], replace(parts[2], carry=((8,),))])
    shown = f"rank 0: digest {c0:016x}, rank 1: digest {c0:016x}, rank 2: digest {c1:016x}"
    assert str(err) == field_text(0, "carry", shown)
    assert (err.field, err.ranks) == ("carry", (2,))
    f0, f1 = digest_of(FP_JSON), digest_of(b'{"length":61,"seed":5}')
    err = mismatch([*parts[:2], replace(parts[2], fingerprint={"seed": 5, "length": 61})])
    shown = f"rank 0: digest {f0:016x}, rank 1: digest {f0:016x}, rank 2: digest {f1:016x}"
    assert str(err) == field_text(0, "fingerprint", shown)
    assert (err.field, err.ranks) == ("fingerprint", (2,))


def test_check_claims_refuses_an_id_done_on_two_ranks() -> None:
    parts = three()
    with pytest.raises(DuplicateIdError, match=r"^sample id 0 was done \(in the loaded state"):
        check_claims(vectors([*parts[:2], replace(parts[2], done=frozenset({2, 0}))]), 0)


@pytest.mark.parametrize(("emitted", "total"), [(7, 6), (5, 6)])
def test_check_claims_refuses_done_ids_that_do_not_add_up(emitted: int, total: int) -> None:
    parts = [replace(p, emitted=emitted) for p in three()]
    err = mismatch(parts, 2)
    assert re.match(
        re.escape(
            f"the states' done ids (base_done 0 + rank 0: 2 + rank 1: 2 + rank 2: 2 = {total}) "
            f"do not account for emitted={emitted}: 1 "
        ),
        str(err),
    )
    assert (err.field, err.ranks) == ("done", (0, 1, 2))


def test_check_claims_counts_base_done_from_the_claim() -> None:
    parts = ranks_state(2, [{5}, {6, 7}], base_done=frozenset({0, 1}))
    assert check_claims(vectors(list(parts)), 0)
    short = [replace(p, base_done=frozenset({0})) for p in parts]
    err = mismatch(short)
    assert str(err).startswith("the states' done ids (base_done 1 + rank 0: 1 + rank 1: 2 = 4)")


def test_check_claims_does_not_count_merged_states() -> None:
    # a merged state's count is checked by EpochProgress.check at load; here base_done
    # is short of emitted and still no count error is raised
    merged = replace(GLOBAL, emitted=5, start_emitted=5, step=6, start_step=6)
    want = hashlib.sha256(packed([*ResumeClaim.of(merged).shared, -1])).hexdigest()[:16]
    assert check_claims(vectors([merged, merged]), 1) == want


# ---- _digest, _hex, _show, _preview -----------------------------------------------------


def test_digest_is_63_bits_of_sha256_of_canonical_json() -> None:
    assert _digest({"b": [1, 2], "a": None}) == digest_of(b'{"a":null,"b":[1,2]}')
    assert _digest([]) == digest_of(b"[]")
    assert _digest([]) == 0x4F53CDA18C2BAA0C >> 1
    assert all(0 <= _digest(v) < 2**63 for v in ([1], {"x": 2}, "s", 0))


def test_hex_is_the_first_eight_bytes() -> None:
    assert _hex(bytes(range(20))) == "0001020304050607"
    assert _hex(b"\xff") == "ff"


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("base_done", (3, 255), "3 ids (digest 00000000000000ff)"),
        ("base_done", 7, "7"),
        ("step", (3, 255), "(3, 255)"),
        ("carry", 16, "digest 0000000000000010"),
        ("fingerprint", 2**62, "digest 4000000000000000"),
        ("carry", "x", "'x'"),
        ("step", 16, "16"),
        ("epoch", (1, 2), "(1, 2)"),
    ],
)
def test_show_writes_digests_as_hex_and_the_rest_as_repr(
    name: str, value: object, shown: str
) -> None:
    assert _show(name, value) == shown


def test_preview_keeps_80_characters_and_cuts_longer_text() -> None:
    assert _preview("a" * 78) == "'" + "a" * 78 + "'"  # 80 characters
    assert _preview("a" * 79) == "'" + "a" * 76 + "..."  # 81 cut to 80
    assert _preview([1, 2]) == "[1, 2]"
    assert len(_preview(list(range(100)))) == 80
