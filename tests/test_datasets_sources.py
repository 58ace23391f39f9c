"""HF `datasets` sources through `ODBDataLoader` on 2 real gloo ranks.

- `transform`: a map-style `datasets.Dataset` whose preprocessing runs on the fly
  (`Dataset.with_transform`: tokenization in `__getitem__`, in the loader's
  DataLoader workers), shuffled;
- `stream`: a streamed `datasets.IterableDataset` (`to_iterable_dataset(num_shards=4)`
  then `.map(tokenize)`), split by node with `datasets.distributed.split_dataset_by_node`
  and read by 2 workers per rank, `partition=False` with `id_fn` (the row's index).

For each, the guarantees docs/ADAPTERS.md gives iterable and map-style sources: each
sample once in the epoch over both ranks, the same number of steps on every rank,
and a resume from a `state_dict()` taken mid-epoch (a new loader, as after a
restart) that trains exactly the rest of the epoch (deterministic: the very steps
the uninterrupted epoch had). The datasets are small and built in the test.

`stream_partitioned` is the trap a user meets first: the same stream without the
split, left to the loader's own partition (the default) with 2 workers. `datasets`
hands each worker only its own shards, so the loader's split by worker would drop
half the samples (measured: 20 of 40 came through); the loader refuses it, naming
`split_dataset_by_node` and `partition=False`.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")
split_dataset_by_node = pytest.importorskip("datasets.distributed").split_dataset_by_node

from gloo_ranks import launch  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.procs, pytest.mark.slow]  # one launch, about 30 s

N = 60
STOP = 3  # steps of epoch 0 before the checkpoint
CASES = ("transform", "stream", "stream_partitioned")


def rows(n: int) -> Any:
    """`n` text rows of long-tailed lengths and their index."""
    texts = [
        " ".join(f"w{(i * 7 + k) % 50}" for k in range(2 + (i * i * 13) % 37)) for i in range(n)
    ]
    return datasets.Dataset.from_dict({"text": texts, "idx": list(range(n))})


def token_ids(text: str) -> list[int]:
    return [1, *(4 + int(w[1:]) for w in text.split())]


def tokenize_batch(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The on-the-fly transform (a batch of rows -> tensors), noting the process it
    ran in."""
    ids = [torch.tensor(token_ids(t)) for t in batch["text"]]
    return {"input_ids": ids, "idx": batch["idx"], "pid": [os.getpid()] * len(ids)}


def tokenize_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": token_ids(row["text"])}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ids = [torch.as_tensor(s["input_ids"]) for s in samples]
    return {
        "input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True),
        "idx": [int(s["idx"]) for s in samples],
        "pid": [int(s.get("pid", -1)) for s in samples],
        "lengths": [len(i) for i in ids],
    }


def source(case: str, rank: int, world: int) -> tuple[Any, dict[str, Any]]:
    if case == "transform":
        opts = {"shuffle": True, "seed": 3}
        return rows(N).with_transform(tokenize_batch), opts
    stream = rows(N).to_iterable_dataset(num_shards=4).map(tokenize_row)
    if case == "stream_partitioned":
        return stream, {}
    split = split_dataset_by_node(stream, rank=rank, world_size=world)
    return split, {"partition": False, "id_fn": lambda s: int(s["idx"])}


def make_loader(case: str, rank: int, world: int) -> ODBDataLoader:
    dataset, opts = source(case, rank, world)
    return ODBDataLoader(
        dataset,
        token_budget=96,
        cost_model="padded",
        collate_fn=collate,
        num_workers=2,
        multiprocessing_context="fork",
        deterministic=True,
        buffer_size=8,
        max_steps_per_round=4,
        **opts,
    )


def steps_of(loader: ODBDataLoader, stop: int | None = None) -> list[dict[str, Any]]:
    out = []
    for batch in loader:
        info = loader.step_info
        assert info is not None
        real = not info.is_pad
        out.append(
            {
                "step": info.step,
                "ids": [int(i) for i in info.sample_ids] if real else [],
                "idx": batch["idx"] if real else [],
                "pids": batch["pid"],
                "lengths": batch["lengths"],
            }
        )
        if stop is not None and len(out) == stop:
            break
    return out


def run_case(case: str, rank: int, world: int) -> dict[str, Any]:
    try:
        full = steps_of(make_loader(case, rank, world))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    first = make_loader(case, rank, world)
    before = steps_of(first, STOP)
    state = first.state_dict()
    first.close()
    resumed = make_loader(case, rank, world)  # as after a restart
    resumed.load_state_dict(state)
    after = steps_of(resumed)
    return {"full": full, "before": before, "after": after, "pid": os.getpid()}


def run_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    return {case: run_case(case, rank, world) for case in CASES}


def same(steps: list[dict[str, Any]]) -> list[Any]:
    """What must match across loaders (not the worker pids)."""
    return [(s["step"], s["ids"], s["lengths"]) for s in steps]


def ids(steps: list[dict[str, Any]]) -> list[int]:
    return [i for s in steps for i in s["ids"]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    ranks = launch("test_datasets_sources:run_rank", 2, {}, tmp_path_factory.mktemp("datasets"))
    assert all(r is not None and r["ok"] for r in ranks), ranks
    return {case: [r[case] for r in ranks if r is not None] for case in CASES}


@pytest.mark.parametrize("case", ["transform", "stream"])
def test_each_sample_once_equal_steps_and_resume(
    results: dict[str, list[dict[str, Any]]], case: str
) -> None:
    r0, r1 = results[case]
    assert len(r0["full"]) == len(r1["full"]) > STOP + 1, "equal steps on both ranks"
    assert [s["step"] for s in r0["full"]] == list(range(len(r0["full"])))
    assert sorted(ids(r0["full"]) + ids(r1["full"])) == list(range(N)), "each sample once"
    for r in (r0, r1):
        for s in r["full"]:
            assert s["idx"] == s["ids"], "the sample id is the row's index"
        # Exact resume: the steps after the checkpoint are the uninterrupted epoch's.
        assert [s["step"] for s in r["before"]] == list(range(STOP))
        assert same(r["before"] + r["after"]) == same(r["full"])
    assert sorted(ids(r0["before"] + r0["after"]) + ids(r1["before"] + r1["after"])) == list(
        range(N)
    )


def test_the_transform_runs_in_the_workers(results: dict[str, list[dict[str, Any]]]) -> None:
    table = rows(N)
    for r in results["transform"]:
        pids = {p for s in r["full"] for p in s["pids"]}
        assert pids and r["pid"] not in pids and -1 not in pids, (pids, r["pid"])
        for s in r["full"]:
            want = [len(token_ids(table[i]["text"])) for i in s["idx"]]
            assert s["lengths"] == want


def test_a_stream_left_to_the_loaders_partition_with_workers_is_refused(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    for r in results["stream_partitioned"]:
        assert "error" in r, "the partitioned stream trained: it drops samples"
        for name in ("split_dataset_by_node", "partition=False", "2 workers"):
            assert name in r["error"], (name, r["error"])
