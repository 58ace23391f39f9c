"""Sample ids unique across ranks (odb_core.identity; proofs/identity_uniqueness.md).

A rank sees only its own ids, so an `id_fn` that gives samples on two ranks one
id, or shards that overlap, went unnoticed. At the close of every epoch each rank
sends the ids it held (emitted, skipped as done before a resume, quota ledger) in
one collective; every rank raises `DuplicateIdError` naming the id and the
ranks. After a load, the done sets of the loaded states are compared the same
way at the first iteration. The pure decision is tested here directly; the rest
on two real gloo ranks, all cases in one launch.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import Dataset  # noqa: E402

from odb_core import DuplicateIdError, ODBDataLoader  # noqa: E402
from odb_core.errors import ODBError  # noqa: E402
from odb_core.identity import check_unique, find_repeats  # noqa: E402
from odb_core.idset import decode  # noqa: E402

pytestmark = [pytest.mark.torch]


def test_find_repeats_names_every_repeated_id_and_its_ranks() -> None:
    assert find_repeats([[1, 2], [3], [4]]) == []
    assert find_repeats([[1, 2, 5], [2, 7], [5, 5]]) == [(2, (0, 1)), (5, (0, 2, 2))]
    with pytest.raises(DuplicateIdError, match=r"sample id 2 .* by ranks 0, 1 .*2 ids repeat"):
        check_unique([[1, 2, 5], [2, 7], [5]])
    with pytest.raises(DuplicateIdError, match="twice by rank 1") as err:
        check_unique([[1], [4, 4]])
    assert (err.value.sample_id, err.value.ranks) == (4, (1, 1))


class Items(Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"input_ids": torch.full((1 + (i * 7919) % 23,), i % 100), "idx": i}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ids = [s["input_ids"] for s in samples]
    return {"input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)}


def half(s: dict[str, Any]) -> int:
    return int(s["idx"]) // 2  # items 2k and 2k+1, on ranks 0 and 1, share id k


def shifted(s: dict[str, Any]) -> int:
    return int(s["idx"]) + 1000  # a correct id_fn: one id per item


class Remap:
    """The dataset index, except item `frm`, which gets id `to`."""

    def __init__(self, frm: int = -1, to: int = -1) -> None:
        self.frm, self.to = frm, to

    def __call__(self, s: dict[str, Any]) -> int:
        return self.to if int(s["idx"]) == self.frm else int(s["idx"])


def make(n: int, **kw: Any) -> ODBDataLoader:
    kw.setdefault("token_budget", 48)
    return ODBDataLoader(Items(n), buffer_size=8, max_steps_per_round=4, collate_fn=collate, **kw)


def epoch(dl: ODBDataLoader) -> dict[str, Any]:
    ids: list[int] = []
    try:
        for _ in dl:
            assert dl.step_info is not None
            ids.extend(dl.step_info.sample_ids)
    except ODBError as exc:
        return {
            "raised": type(exc).__name__,
            "message": str(exc),
            "id": getattr(exc, "sample_id", None),
            "ranks": list(getattr(exc, "ranks", ())),
            "ids": ids,
        }
    return {"raised": None, "ids": ids}


SAMPLERS = [list(range(0, 40)), list(range(30, 70))]  # both ranks own 30..39


def run_id_cases(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["half"] = epoch(make(80, id_fn=half))
    out["shifted"] = epoch(make(80, id_fn=shifted))
    out["overlapping samplers"] = epoch(make(70, sampler=SAMPLERS[rank], partition=False))
    out["overlapping samplers, quota"] = epoch(
        make(70, sampler=SAMPLERS[rank], partition=False, mode="quota", quota=30)
    )
    # Resumes: colliding ids done before the checkpoint (found at the first
    # iteration), and an id done on rank 0 that rank 1's last item gets after the
    # checkpoint (found at the close, and only there: rank 0 skips its own item
    # with that id as done, rank 1 emits the other).
    for name in ("resume, half", "resume, remapped"):
        fn: Any = half if name == "resume, half" else Remap()
        dl = make(80, id_fn=fn, token_budget=24)
        it = iter(dl)
        for _ in range(3):
            next(it)
        state = json.loads(json.dumps(dl.state_dict()))
        if name == "resume, remapped":
            import torch.distributed as dist

            done: list[Any] = [None] * world
            dist.all_gather_object(done, sorted(decode(state["done"], "done")))
            fn = Remap(frm=79, to=min(done[0]))  # 79: rank 1's last item, not done
            assert 79 not in done[1]
        again = make(80, id_fn=fn, token_budget=24)
        again.load_state_dict(state)
        out[name] = epoch(again)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from gloo_ranks import launch, ok

    out = tmp_path_factory.mktemp("ids")
    return ok(launch("test_cross_rank_ids:run_id_cases", 2, {}, out))


@pytest.mark.parametrize(
    ("case", "sample_id"),
    [
        ("half", 0),
        ("overlapping samplers", 30),
        ("overlapping samplers, quota", 30),
        ("resume, half", None),  # whichever colliding ids the first steps emitted
        ("resume, remapped", None),
    ],
)
def test_an_id_on_two_ranks_raises_on_both_naming_it(
    results: list[dict[str, Any]], case: str, sample_id: int | None
) -> None:
    sample_id = results[0][case].get("id") if sample_id is None else sample_id
    for rank, r in enumerate(results):
        res = r[case]
        assert res["raised"] == "DuplicateIdError", (rank, res)
        assert res["id"] == sample_id and res["ranks"] == [0, 1], (rank, res)
        assert f"sample id {sample_id} was" in res["message"] and "ranks 0, 1" in res["message"]
    if case == "resume, remapped":  # found at the close, not among the loaded done ids
        assert "emitted or owned" in results[0][case]["message"]


def test_a_correct_id_fn_raises_nothing(results: list[dict[str, Any]]) -> None:
    ids = [i for r in results for i in r["shifted"]["ids"]]
    assert all(r["shifted"]["raised"] is None for r in results)
    assert sorted(ids) == [i + 1000 for i in range(80)]


def test_the_check_is_one_collective_per_epoch_not_per_step() -> None:
    """Counting the transport's object collectives at world size 1: one at each
    epoch's close, plus one at the first iteration after a load; none per step."""
    dl = make(40, id_fn=shifted)
    calls: list[tuple[int, ...]] = []
    exchange = dl.transport.exchange

    def counted(tag: tuple[int, ...], ids: Any, what: str = "") -> list[list[int]]:
        calls.append(tag)
        return exchange(tag, ids, what)

    dl.transport.exchange = counted  # type: ignore[method-assign]
    steps = sum(1 for _ in dl)
    assert steps > 5 and len(calls) == 1
    state = dl.state_dict()
    dl.load_state_dict(state)
    assert sum(1 for _ in dl) > 5 and len(calls) == 3  # the resume check, the next close
