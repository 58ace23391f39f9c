"""ODBDataLoader across real processes: gloo ranks on 127.0.0.1, real DataLoader workers.

Each test spawns W rank processes (torch.multiprocessing, spawn) that iterate the
loader and write what every step looked like; the test then checks step
alignment, exactly-once coverage and identical global metadata across ranks,
and validates the recorded protocol trace against the model.
"""

from __future__ import annotations

import gc
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from guards import HANG_GUARD_S

torch = pytest.importorskip("torch")

import gloo_ranks  # noqa: E402
from torch.utils.data import Dataset, IterableDataset  # noqa: E402

from odb_core import ODBDataLoader, StepMeta, read_step_meta  # noqa: E402
from odb_core.verify.tlc import validate_trace_tlc  # noqa: E402
from odb_core.verify.trace_validation import ProtocolTrace, validate_trace  # noqa: E402

pytestmark = pytest.mark.torch


# ---- what runs inside a rank ---------------------------------------------------------


def length_of(i: int) -> int:
    return 1 + (i * 7919) % 37


class DelayedText(Dataset[dict[str, Any]]):
    """Sample i has a fixed length; producing it sleeps a random (seeded) time."""

    def __init__(self, n: int, max_delay: float = 0.0) -> None:
        self.n = n
        self.max_delay = max_delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.max_delay:
            time.sleep(random.Random(i).random() * self.max_delay)
        return {"input_ids": torch.full((length_of(i),), i % 100)}


class DelayedChat(DelayedText):
    """DelayedText with labels: the first third of each sample is a masked prompt."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        out = super().__getitem__(i)
        labels = out["input_ids"].clone()
        labels[: len(labels) // 3] = -100
        return {**out, "labels": labels, "idx": torch.tensor(i)}


class Stream(IterableDataset[dict[str, Any]]):
    def __init__(self, n: int, max_delay: float = 0.0) -> None:
        self.n = n
        self.max_delay = max_delay

    def __iter__(self) -> Any:
        for i in range(self.n):
            if self.max_delay:
                time.sleep(random.Random(i).random() * self.max_delay)
            yield {"input_ids": torch.full((length_of(i),), i % 100), "pos": i}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ids = [s["input_ids"] for s in samples]
    out = {"input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)}
    if "idx" in samples[0]:
        out["idx"] = torch.stack([s["idx"] for s in samples])
    return out


def make_loader(rank: int, world: int, spec: dict[str, Any]) -> ODBDataLoader:
    kw = dict(spec.get("loader", {}))
    kw.setdefault("token_budget", 64)
    kw.setdefault("buffer_size", 8)
    kw.setdefault("max_steps_per_round", 4)
    if spec.get("iterable"):
        ds: Any = Stream(spec["n"], spec.get("delay", 0.0))
    elif spec.get("chat"):
        ds = DelayedChat(spec["n"], spec.get("delay", 0.0))
    else:
        ds = DelayedText(spec["n"], spec.get("delay", 0.0))
    if "shards" in spec:
        kw["sampler"] = spec["shards"][rank]
        kw["partition"] = False
    if "orders" in spec:  # a sampler that is (wrongly) not seeded alike on every rank
        kw["sampler"] = spec["orders"][rank]
    return ODBDataLoader(ds, collate_fn=collate, **kw)


def step_record(loader: ODBDataLoader, batch: dict[str, Any]) -> list[Any]:
    info = loader.step_info
    assert info is not None
    assert batch["input_ids"].shape[0] == max(1, info.local_samples)
    meta = read_step_meta(batch)  # in band, pads included
    assert meta == StepMeta.from_info(info) and meta.world_size == loader.world_size
    assert meta.is_pad == info.is_pad and meta.loss_scale == info.loss_scale
    return [
        info.step,
        info.is_pad,
        list(info.sample_ids),
        info.local_samples,
        info.global_samples,
        info.local_tokens,
        info.global_tokens,
        info.loss_scale,
        info.window,
        info.sync_gradients,
        info.local_loss_tokens,
        info.global_loss_tokens,
        info.window_loss_tokens,
        info.window_samples,
    ]


def run_epochs(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    loader = make_loader(rank, world, spec)
    epochs = []
    for epoch in range(spec.get("epochs", 1)):
        loader.set_epoch(epoch)
        steps = []
        for batch in loader:
            steps.append(step_record(loader, batch))
            if spec.get("die", {}).get(str(rank)) == len(steps):
                os._exit(1)
            if spec.get("hang", {}).get(str(rank)) == len(steps):
                time.sleep(120)
        epochs.append(steps)
    return {"epochs": epochs}


def run_quota_epochs(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    loader = make_loader(rank, world, spec)
    epochs = []
    for epoch in range(spec["epochs"]):
        loader.set_epoch(epoch)
        steps = [step_record(loader, batch) for batch in loader]
        epochs.append(
            {
                "steps": steps,
                "carried_in": list(loader.carried_in),
                "ledger": list(loader.ledger),
                "carried_count": loader.carried_count,
            }
        )
    return {"epochs": epochs}


def run_until_failure(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    loader = make_loader(rank, world, spec)
    last = time.monotonic()
    steps = 0
    try:
        for _ in loader:
            steps += 1
            if spec.get("die", {}).get(str(rank)) == steps:
                os._exit(1)
            if spec.get("hang", {}).get(str(rank)) == steps:
                time.sleep(120)
            last = time.monotonic()
    except Exception as exc:
        return {"raised": type(exc).__name__, "after_s": time.monotonic() - last, "steps": steps}
    return {"raised": None, "steps": steps}


def run_resume_phase_a(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Stop mid-epoch, save; then a fresh loader on the same rank resumes from it."""
    loader = make_loader(rank, world, spec)
    loader.set_epoch(spec["epoch"])
    before = []
    it = iter(loader)
    for _ in range(spec["stop_at"]):
        before.append(step_record(loader, next(it)))
    state = json.loads(json.dumps(loader.state_dict()))  # plain data only
    Path(spec["state_dir"], f"state{rank}.json").write_text(json.dumps(state))
    again = make_loader(rank, world, spec)
    again.load_state_dict(state)
    again.set_epoch(spec["epoch"])
    after = [step_record(again, b) for b in again]
    return {"before": before, "after": after}


def run_resume_phase_b(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Resume at another world size from the list of every old rank's state."""
    files = sorted(Path(spec["state_dir"]).glob("state*.json"))
    states = [json.loads(p.read_text()) for p in files]
    loader = make_loader(rank, world, spec)
    loader.load_state_dict(states)
    loader.set_epoch(spec["epoch"])
    return {"after": [step_record(loader, b) for b in loader]}


def run_windows(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Each loader config of spec["configs"], for spec["epochs"] epochs without
    set_epoch (the loader advances them itself)."""
    out = []
    for extra in spec["configs"]:
        loader = make_loader(rank, world, {**spec, "loader": {**spec["loader"], **extra}})
        epochs = []
        for _ in range(spec["epochs"]):
            epochs.append([step_record(loader, b) for b in loader])
            epochs[-1].append(loader.epoch)
        out.append(epochs)
    return {"configs": out}


def _trace(loader: ODBDataLoader, batches: Any) -> list[Any]:
    out = []
    for b in batches:
        info = loader.step_info
        assert info is not None
        out.append([list(read_step_meta(b)), list(info.sample_ids), b["idx"].tolist()])
    return out


def run_exact_resume(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Deterministic: the uninterrupted epoch, then stop at spec["stop_at"], save, and
    resume in a fresh loader (same world size): the rest must be the same steps."""
    full = make_loader(rank, world, spec)
    whole = _trace(full, full)
    cut = make_loader(rank, world, spec)
    it = iter(cut)
    head = _trace(cut, (next(it) for _ in range(spec["stop_at"])))
    state = json.loads(json.dumps(cut.state_dict()))
    again = make_loader(rank, world, spec)
    again.load_state_dict(state)
    return {"whole": whole, "head": head, "rest": _trace(again, again)}


def run_epoch_disagreement(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 lets the loader advance to epoch 1; rank 1 repeats epoch 0."""
    loader = make_loader(rank, world, spec)
    for _ in loader:
        pass
    if rank == 1:
        loader.set_epoch(0, repeat=True)
    try:
        steps = sum(1 for _ in loader)
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc), "epoch": loader.epoch}
    return {"raised": None, "steps": steps, "epoch": loader.epoch}


def run_cases(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Each case of spec["cases"] in turn on the same ranks: its function of this
    module and its spec; what it returned, or what it raised (that case only)."""
    out: dict[str, Any] = {}
    for name, (fn, case) in spec["cases"].items():
        try:
            out[name] = {"ok": True, **globals()[fn](rank, world, case)}
        except Exception as exc:
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        gc.collect()  # the case's loaders and their workers are gone before the next
        torch.distributed.barrier()
    return out


# ---- the launcher and the checks -------------------------------------------------------


def launch(
    fn: str, world: int, spec: dict[str, Any], out: Path, timeout: float = HANG_GUARD_S
) -> list[dict[str, Any] | None]:
    """Run `fn` of this module on `world` gloo ranks; a rank named in the spec's
    "hang" map hangs on purpose and is not waited for."""
    hung = {int(r) for r in spec.get("hang", {})}
    return gloo_ranks.launch(f"{__name__}:{fn}", world, spec, out, timeout, hung=hung)


def ok_results(results: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} wrote no result"
        assert res["ok"], f"rank {r} failed: {res['error']}"
    return [r for r in results if r is not None]


def check_aligned(per_rank: list[list[list[Any]]], world: int) -> list[int]:
    """Equal step counts, identical global metadata, local parts summing to the
    global counts, pads flagged with scale 0, scales summing to the step's share of
    its window; returns every real id emitted."""
    counts = [len(s) for s in per_rank]
    assert len(set(counts)) == 1, f"step counts differ across ranks: {counts}"
    ids: list[int] = []
    for t in range(counts[0]):
        rows = [s[t] for s in per_rank]
        glob = {(row[0], row[4], row[6]) for row in rows}
        assert len(glob) == 1, f"step {t}: global metadata differs across ranks: {glob}"
        _, global_samples, global_tokens = glob.pop()
        assert sum(row[3] for row in rows) == global_samples
        assert sum(row[5] for row in rows) == global_tokens
        for row in rows:
            if row[1]:
                assert row[2] == [] and row[3] == 0 and row[7] == 0.0
            ids.extend(row[2])
        # Over the ranks, the step's share of its window's global mean (1 window =
        # 1 step without accumulation: the scales sum to W).
        window_loss, step_loss = rows[0][12], rows[0][11]
        share = world * step_loss / window_loss if window_loss else 0.0
        assert sum(row[7] for row in rows) == pytest.approx(share)
    return ids


def assert_exactly_once(ids: list[int], expected: list[int]) -> None:
    assert len(ids) == len(set(ids)), "a sample id was emitted twice"
    missing, extra = set(expected) - set(ids), set(ids) - set(expected)
    assert not missing and not extra, f"missing {sorted(missing)[:10]}, extra {sorted(extra)[:10]}"


# ---- tests -------------------------------------------------------------------------


START_METHODS = [("fork", 2), ("spawn", 1), ("forkserver", 1)]
RESUME_SEEDS = [1, 2]


def start_method_spec(method: str, workers: int) -> dict[str, Any]:
    return {
        "n": 90,
        "delay": 0.002,
        "epochs": 2,
        "loader": {
            "num_workers": workers,
            "multiprocessing_context": method,
            "persistent_workers": True,
            "shuffle": True,
        },
    }


def quota_spec(threaded: bool) -> dict[str, Any]:
    return {
        "n": 160,
        "epochs": 4,
        "delay": 0.002,  # uneven arrival: the windows differ from run to run
        "loader": {
            "mode": "quota",
            "quota": 110,
            "shuffle": True,
            "seed": 3,
            "prefetch_thread": threaded,
        },
    }


def resume_spec(seed: int, state_dir: Path) -> dict[str, Any]:
    """Phase a at world 2: stop at a random step, save, resume in a fresh loader."""
    rng = random.Random(seed)
    return {
        "n": 120,
        "epoch": 1,
        "state_dir": str(state_dir),
        "delay": 0.001,
        "stop_at": rng.randrange(1, 8),
        # Each rank resumes its own state at the same world size: static sharding (a
        # dynamic run resumes merged states: tests/test_torch_dynamic.py).
        "loader": {
            "num_workers": 1,
            "multiprocessing_context": "fork",
            "shuffle": True,
            "sharding": "static",
        },
    }


WINDOWS_SPEC = {
    # Uneven shards give pad steps; each config runs 2 epochs without set_epoch.
    "n": 95,
    "chat": True,
    "delay": 0.0005,
    "epochs": 2,
    "shards": [list(range(0, 70)), list(range(70, 95))],
    "loader": {"num_workers": 0, "max_steps_per_round": 2},
    "configs": [{"grad_accum_steps": 3}, {"tokens_per_update": 150, "prefetch_thread": False}],
}

EXACT_RESUME_SPEC = {
    "n": 110,
    "chat": True,
    "stop_at": 5,
    "loader": {
        "num_workers": 1,
        "multiprocessing_context": "fork",
        "shuffle": True,
        "deterministic": True,
        "grad_accum_steps": 2,
        "max_steps_per_round": 2,
    },
}


def two_rank_cases(out: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """The runs on two ranks that end well: case -> (function, spec)."""
    for seed in RESUME_SEEDS:
        (out / f"resume{seed}").mkdir()
    return {
        # two forked workers each, random per-sample delays, shuffled, traced
        "traced": (
            "run_epochs",
            {
                "n": 150,
                "delay": 0.004,
                "loader": {
                    "num_workers": 2,
                    "multiprocessing_context": "fork",
                    "shuffle": True,
                    "samples_per_fetch": 2,
                    "trace_dir": str(out / "trace"),
                },
            },
        ),
        "uneven": (
            "run_epochs",
            {
                "n": 160,
                "delay": 0.001,
                "shards": [list(range(0, 120)), list(range(120, 160))],
                "loader": {"num_workers": 0, "prefetch_thread": False},  # inline protocol loop
            },
        ),
        **{f"start-{m}": ("run_epochs", start_method_spec(m, w)) for m, w in START_METHODS},
        **{f"quota-{t}": ("run_quota_epochs", quota_spec(t)) for t in (True, False)},
        **{
            f"resume{seed}": ("run_resume_phase_a", resume_spec(seed, out / f"resume{seed}"))
            for seed in RESUME_SEEDS
        },
        "windows": ("run_windows", WINDOWS_SPEC),
        "exact-resume": ("run_exact_resume", EXACT_RESUME_SPEC),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One launch of two gloo ranks runs every case of `two_rank_cases` in turn
    (`run_cases`), and each test checks its own case: the ranks start (spawn,
    torch, gloo) once, not once a case. A case that raises fails its own test."""
    out = tmp_path_factory.mktemp("two-ranks")
    spec = {"cases": two_rank_cases(out)}
    return out, ok_results(launch("run_cases", 2, spec, out))


def case(two_ranks: tuple[Path, list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    """Each rank's result of one case of the `two_ranks` launch."""
    per_rank = [r[name] for r in two_ranks[1]]
    for r, res in enumerate(per_rank):
        assert res["ok"], f"rank {r} failed in case {name}: {res['error']}"
    return per_rank


@pytest.fixture(scope="module")
def traced_run(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> tuple[list[dict[str, Any]], Path]:
    return case(two_ranks, "traced"), two_ranks[0] / "trace"


def test_two_ranks_random_delays_align_and_cover_exactly_once(
    traced_run: tuple[list[dict[str, Any]], Path],
) -> None:
    results, _ = traced_run
    ids = check_aligned([r["epochs"][0] for r in results], 2)
    assert_exactly_once(ids, list(range(150)))


def test_real_run_trace_validates_against_the_model(
    traced_run: tuple[list[dict[str, Any]], Path],
) -> None:
    _, trace_dir = traced_run
    files = sorted(trace_dir.glob("*.json"))
    assert len(files) == 2
    trace = ProtocolTrace.merge(files)
    report = validate_trace(trace)
    assert report.ok, report.reason
    observed = {e["sample"][0] for r in trace.ranks for e in r.events if e["action"] == "Observe"}
    assert observed == set(range(150))


@pytest.mark.tlc
def test_real_run_trace_validates_under_tlc(
    traced_run: tuple[list[dict[str, Any]], Path],
) -> None:
    _, trace_dir = traced_run
    report = validate_trace_tlc(ProtocolTrace.merge(sorted(trace_dir.glob("*.json"))))
    assert report.ok, report.reason


def test_uneven_shards_three_to_one_pad_the_short_rank(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    results = case(two_ranks, "uneven")
    per_rank = [r["epochs"][0] for r in results]
    ids = check_aligned(per_rank, 2)
    assert_exactly_once(ids, list(range(160)))
    assert sum(row[1] for row in per_rank[1]) > 0, "the short rank never padded"
    assert sum(row[1] for row in per_rank[0]) == 0


@pytest.mark.parametrize("method", [m for m, _ in START_METHODS])
def test_start_methods_with_persistent_workers_over_two_epochs(
    two_ranks: tuple[Path, list[dict[str, Any]]], method: str
) -> None:
    results = case(two_ranks, f"start-{method}")
    orders = []
    for epoch in range(2):
        per_rank = [r["epochs"][epoch] for r in results]
        ids = check_aligned(per_rank, 2)
        assert_exactly_once(ids, list(range(90)))
        orders.append(ids)
    assert orders[0] != orders[1], "set_epoch did not reshuffle"


def test_iterable_dataset_sharded_by_rank_and_worker(tmp_path: Path) -> None:
    spec = {
        "n": 100,
        "iterable": True,
        "delay": 0.001,
        "loader": {"num_workers": 2, "multiprocessing_context": "fork"},
    }
    results = ok_results(launch("run_epochs", 3, spec, tmp_path))
    ids = check_aligned([r["epochs"][0] for r in results], 3)
    assert_exactly_once(ids, list(range(100)))


@pytest.mark.parametrize("seed", RESUME_SEEDS)
def test_resume_at_a_random_step_same_and_other_world_size(
    two_ranks: tuple[Path, list[dict[str, Any]]], tmp_path: Path, seed: int
) -> None:
    """Phase a (two ranks) is a case of `two_ranks`; phase b resumes its saved
    states on three ranks."""
    n = 120
    a = case(two_ranks, f"resume{seed}")
    spec_a = resume_spec(seed, two_ranks[0] / f"resume{seed}")
    common = {k: spec_a[k] for k in ("n", "epoch", "state_dir", "delay")}
    before = check_aligned([r["before"] for r in a], 2)
    after_same = check_aligned([r["after"] for r in a], 2)
    assert_exactly_once(before + after_same, list(range(n)))
    assert [r["after"][0][0] for r in a] == [spec_a["stop_at"]] * 2, "steps do not continue"

    spec_b = {**common, "loader": {"num_workers": 0, "shuffle": True, "sharding": "static"}}
    b = ok_results(launch("run_resume_phase_b", 3, spec_b, tmp_path / "b"))
    after_other = check_aligned([r["after"] for r in b], 3)
    assert_exactly_once(before + after_other, list(range(n)))


@pytest.mark.parametrize("threaded", [True, False])
def test_quota_mode_carries_every_unemitted_id_into_the_next_epoch(
    two_ranks: tuple[Path, list[dict[str, Any]]], threaded: bool
) -> None:
    spec = quota_spec(threaded)
    n, quota, n_epochs = spec["n"], spec["loader"]["quota"], spec["epochs"]
    results = case(two_ranks, f"quota-{threaded}")
    previous: list[int] = []
    for e in range(n_epochs):
        per_rank = [r["epochs"][e] for r in results]
        ids = check_aligned([p["steps"] for p in per_rank], 2)  # same closing step
        assert len(ids) == len(set(ids)), f"epoch {e}: an id was emitted twice"
        assert len(ids) >= quota  # closed by the quota, not by a rank running dry
        ledger = per_rank[0]["ledger"]
        assert all(p["ledger"] == ledger for p in per_rank), "ranks disagree on the ledger"
        assert all(p["carried_in"] == previous for p in per_rank)
        assert all(p["carried_count"] == len(ledger) for p in per_rank)
        assert not set(ledger) & set(ids)
        assert sorted(ids + ledger) == list(range(n)), f"epoch {e}: an id was dropped"
        assert set(previous) <= set(ids), f"epoch {e}: a carried id was not emitted"
        previous = ledger
    assert previous, "the quota left nothing to carry: the test checks nothing"


def test_ranks_with_different_sample_orders_fail_loudly(tmp_path: Path) -> None:
    orders = [list(range(40)), list(reversed(range(40)))]
    spec = {"n": 40, "orders": orders, "loader": {"num_workers": 0}}
    for res in launch("run_until_failure", 2, spec, tmp_path):
        assert res is not None and res["ok"], res
        assert res["raised"] == "ODBPeerError" and res["steps"] == 0, res


def test_killed_peer_raises_on_every_survivor(tmp_path: Path) -> None:
    timeout = 5
    spec = {"n": 300, "die": {"2": 2}, "loader": {"num_workers": 0, "peer_timeout": timeout}}
    results = launch("run_until_failure", 3, spec, tmp_path)
    assert results[2] is None  # the killed rank
    for rank in (0, 1):
        res = results[rank]
        assert res is not None and res["ok"], res
        assert res["raised"] == "ODBPeerError", res
        assert res["after_s"] < timeout + 2, res


def test_hung_peer_raises_within_peer_timeout(tmp_path: Path) -> None:
    timeout = 3
    loader_kw = {"num_workers": 0, "peer_timeout": timeout, "prefetch_thread": False}
    spec = {"n": 300, "hang": {"1": 2}, "loader": loader_kw}
    results = launch("run_until_failure", 2, spec, tmp_path)
    res = results[0]
    assert res is not None and res["ok"], res
    assert res["raised"] == "ODBPeerError", res
    assert res["after_s"] < timeout + 3, res


def check_windows(per_rank: list[list[list[Any]]], world: int) -> None:
    """Every rank has the same (window, sync_gradients, window loss tokens) sequence;
    the ranks' local loss tokens over a window sum to its window_loss_tokens; every
    window ends with one sync step; the scales sum to W over a window."""
    seqs = [[(row[8], row[9], row[12], row[13]) for row in steps] for steps in per_rank]
    assert all(s == seqs[0] for s in seqs), "ranks disagree on the windows"
    windows: dict[int, list[list[Any]]] = {}
    for steps in per_rank:
        for row in steps:
            windows.setdefault(row[8], []).append(row)
    assert sorted(windows) == list(range(len(windows)))
    for w, rows in windows.items():
        assert sum(row[10] for row in rows) == rows[0][12], f"window {w}: local sums differ"
        assert sum(row[11] for row in rows) == world * rows[0][12]
        assert sum(row[3] for row in rows) == rows[0][13]
        assert sum(row[7] for row in rows) == pytest.approx(world)
    for steps in per_rank:
        syncs = [row[9] for row in steps]
        assert syncs[-1], "the last (short) window did not close with the epoch"
        ends = [row[8] for row, sync in zip(steps, syncs, strict=True) if sync]
        assert ends == list(range(len(windows)))


def test_two_ranks_windows_pads_and_auto_epochs(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    spec = WINDOWS_SPEC
    results = case(two_ranks, "windows")
    for c, config in enumerate(spec["configs"]):
        for e in range(2):
            per_rank = [r["configs"][c][e][:-1] for r in results]
            assert [r["configs"][c][e][-1] for r in results] == [e, e], "epoch not advanced"
            ids = check_aligned(per_rank, 2)
            assert_exactly_once(ids, list(range(95)))
            check_windows(per_rank, 2)
            assert any(row[1] for row in per_rank[1]), f"{config}: the short rank never padded"
            if "grad_accum_steps" in config:
                sizes = [row[8] for row in per_rank[0]]
                counts = [sizes.count(w) for w in sorted(set(sizes))]
                assert counts[:-1] == [3] * (len(counts) - 1) and 1 <= counts[-1] <= 3
            else:
                for w in set(row[8] for row in per_rank[0]):
                    rows = [row for row in per_rank[0] if row[8] == w]
                    before_last = sum(row[11] for row in rows[:-1])
                    assert before_last < 150, "a tokens window stayed open past the threshold"


def test_two_ranks_exact_deterministic_resume(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    results = case(two_ranks, "exact-resume")
    for r, res in enumerate(results):
        whole, head, rest = res["whole"], res["head"], res["rest"]
        assert len(whole) > 8
        assert head == whole[:5], f"rank {r}: the interrupted run differs"
        assert rest == whole[5:], f"rank {r}: the resumed run is not the uninterrupted one"
    assert [len(r["whole"]) for r in results] == [len(results[0]["whole"])] * 2


def test_ranks_in_different_epochs_fail_loudly(tmp_path: Path) -> None:
    # Unshuffled, both epochs have the same order: only the epoch in the tag differs.
    spec = {"n": 40, "loader": {"num_workers": 0, "peer_timeout": 20}}
    for res in launch("run_epoch_disagreement", 2, spec, tmp_path):
        assert res is not None and res["ok"], res
        assert res["raised"] == "ODBPeerError" and "order digest" in res["message"], res
