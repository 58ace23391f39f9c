"""The simulator's fidelity check (simulator/bench_fit.py, simulator/fidelity.py,
benchmarks/sim_fidelity.py) on synthetic bench runs with known parameters: the
fit recovers them, a fit that ignores padding tokens is caught, and the command
predicts and compares. Nothing here is timed."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from benchmark_scripts import load_benchmark

from simulator.bench_fit import (
    BenchFormatError,
    StepRecord,
    fit_prep,
    fit_steps,
    nonnegative_lstsq,
    pass_s,
    predict_step,
    step_records,
    without_first_repeat,
)
from simulator.bench_workload import BenchSamples
from simulator.cpu_profile import STEP_FEATURES, CPUProfile, PrepModel, StepModel
from simulator.fidelity import predict

TRUE_STEP = StepModel(step_s=0.19, token_s=9e-4, pad_token_s=5e-5, visual_token_s=4e-4)
TRUE_PREP = PrepModel(sample_s=2e-3, visual_token_s=5e-5)
TRUE_WORKER = PrepModel(sample_s=3e-3, visual_token_s=7.5e-5)  # 1.5 x the rank process's


sim_fidelity = load_benchmark("sim_fidelity")
FIELDS = ["t_s", "wait_s", "compute_s", "real_tokens", "computed_tokens", "samples", "is_pad"]


def _counts(n: int, seed: int) -> BenchSamples:
    rng = np.random.default_rng(seed)
    text = rng.integers(10, 300, n)
    visual = np.where(rng.random(n) < 0.8, rng.integers(4, 400, n), 0)
    # the profile runs at half the bench's speed (level factor 2, fitted back)
    prep = (TRUE_PREP.sample_s + TRUE_PREP.visual_token_s * visual) / 2
    return BenchSamples(seed, text.astype(np.int64), visual.astype(np.int64), prep)


def _timelines(counts: BenchSamples, step: StepModel, world: int, seed: int) -> dict[str, Any]:
    """Every rank's timeline under `step`, for random padded batches of 1-6 samples
    and random data waits (so the slowest rank is not always the largest batch);
    odb-padded's first wait is its worker preprocessing the rank's whole shard."""
    rng = random.Random(seed)
    ids = list(range(counts.n))
    length = counts.text + counts.visual
    out: dict[str, Any] = {}
    for name in ("standard", "grouped", "gmt", "odb-padded"):
        rng.shuffle(ids)
        plan = [
            [ids[s + 6 * r : s + 6 * r + rng.randint(1, 6)] for r in range(world)]
            for s in range(0, counts.n - 6 * world, 6 * world)
        ]
        shards = [[i for batches in plan for i in batches[r]] for r in range(world)]
        first = [sum(TRUE_WORKER.sample_cost(counts.visual[i]) for i in sh) for sh in shards]
        per_rank: list[dict[str, list[Any]]] = [{"timeline": [], "ids": []} for _ in range(world)]
        t = 0.0
        for j, batches in enumerate(plan):
            got, rows = [], []
            for r, batch in enumerate(batches):
                real = int(length[batch].sum())
                computed = len(batch) * int(length[batch].max())
                vis = int(counts.visual[batch].sum())
                wait = first[r] if name == "odb-padded" and j == 0 else rng.uniform(0.0, 0.3)
                got.append(t + wait)
                rows.append((batch, wait, real, computed, vis))
            done = (
                max(g + step.rank_s(x[2], x[3], x[4]) for g, x in zip(got, rows, strict=True))
                + step.step_s
            )
            for r, (batch, wait, real, computed, _) in enumerate(rows):
                per_rank[r]["timeline"].append(
                    [t, wait, done - got[r], real, computed, len(batch), False]
                )
                per_rank[r]["ids"].append(batch)
            t = done
        out[name] = per_rank
    return out


def _bench_json(counts: BenchSamples, world: int = 2) -> dict[str, Any]:
    true_pass = pass_s(TRUE_PREP, counts.visual, world)
    runs = [{"precompute_s": true_pass, "samples_per_s": 1.0, "samples_per_s_incl_precompute": 0.9}]
    return {
        "params": {
            "model": "qwen3-vl-tiny",
            "samples": counts.n,
            "seed": counts.seed,
            "max_len": 1024,
            "ranks": world,
            "budget": 2048,
            "fixed_batch": 2,
            "workers": 1,
            "buffer_size": None,
        },
        "timeline_fields": FIELDS,
        "timeline_ranks": {  # two repeats
            name: [per_rank, _timelines(counts, TRUE_STEP, world, counts.seed + 99)[name]]
            for name, per_rank in _timelines(counts, TRUE_STEP, world, counts.seed).items()
        },
        "strategies": {
            "standard": {"wall_s": 10.0, "data_wait_s": 0.5, "runs": runs},
            "grouped": {"wall_s": 9.0, "data_wait_s": 0.5, "precompute_s": true_pass, "runs": runs},
            "gmt": {"wall_s": 8.0, "data_wait_s": 0.5, "precompute_s": true_pass, "runs": runs},
            "odb-padded": {"wall_s": 7.0, "data_wait_s": 2.0, "runs": runs},
        },
        "ratios": {
            "odb-padded/standard": 1.5,
            "odb-padded/grouped_incl_length_pass": 1.3,
            "odb-padded/gmt_incl_precompute": 1.1,
        },
    }


def _recovers(fitted: StepModel, true: StepModel, rel: float = 1e-6) -> bool:
    return all(
        abs(f - t) <= rel * abs(t)
        for f, t in zip(fitted.coefficients, true.coefficients, strict=True)
    )


def _slowest(record: StepRecord, model: StepModel, with_wait: bool) -> int:
    ends = [
        (r.delta_s if with_wait else 0.0) + model.rank_s(r.real, r.computed, r.visual)
        for r in record.ranks
    ]
    return ends.index(max(ends))


def test_fit_recovers_known_step_parameters() -> None:
    counts = _counts(240, 0)
    records = step_records(_bench_json(counts), counts)
    fit = fit_steps(records)
    assert _recovers(fit.model, TRUE_STEP), fit.model
    assert fit.rms_s < 1e-9 and fit.r2 > 1 - 1e-9
    assert all(e < 1e-9 for e in fit.per_strategy_rel_err.values())
    # the max over ranks matters: some steps' slowest rank is not the largest batch
    largest = [_slowest(r, StepModel(0.0, 1.0, 1.0, 0.0), with_wait=False) for r in records]
    slowest = [_slowest(r, TRUE_STEP, with_wait=True) for r in records]
    assert largest != slowest


@pytest.mark.parametrize("dropped", ["pad_token_s", "visual_token_s"])
def test_a_fit_ignoring_a_term_is_caught(dropped: str) -> None:
    """The deliberately broken variants: the same fit without padding tokens (or
    without visual tokens) does not recover the parameters."""
    counts = _counts(240, 0)
    records = step_records(_bench_json(counts), counts)
    fit = fit_steps(records, features=[f for f in STEP_FEATURES if f != dropped])
    assert not _recovers(fit.model, TRUE_STEP)
    assert fit.rms_s > 1e-4


def test_max_over_ranks_is_needed() -> None:
    """Fitting rank 0's batch alone (the one timeline the bench had before) is caught."""
    counts = _counts(240, 0)
    records = step_records(_bench_json(counts), counts)
    rank0 = [StepRecord(r.strategy, r.y_s, r.ranks[:1]) for r in records]
    assert not _recovers(fit_steps(rank0).model, TRUE_STEP)
    exact = [predict_step(TRUE_STEP, r) for r in records]
    assert max(abs(e - r.y_s) for e, r in zip(exact, records, strict=True)) < 1e-9


def test_a_negative_cost_is_held_at_zero() -> None:
    """y = 2 a - 0.5 b: plain least squares (the broken variant) gives b a negative
    cost; the fit holds it at 0 and refits a."""
    rng = np.random.default_rng(0)
    x = rng.uniform(1, 10, (40, 2))
    y = 2 * x[:, 0] - 0.5 * x[:, 1]
    plain, *_ = np.linalg.lstsq(x, y, rcond=None)
    assert plain[1] < 0
    coef, se, held = nonnegative_lstsq(x, y)
    assert held == [1] and coef[1] == 0.0 and se[1] == 0.0 and coef[0] > 0
    assert coef[0] == pytest.approx(float(x[:, 0] @ y / (x[:, 0] @ x[:, 0])))


def test_prep_shape_from_profile_level_from_the_pass() -> None:
    counts = _counts(120, 3)
    prep, level = fit_prep(counts, pass_s(TRUE_PREP, counts.visual, 2), 2)
    assert level == pytest.approx(2.0)
    assert prep.sample_s == pytest.approx(TRUE_PREP.sample_s)
    assert prep.visual_token_s == pytest.approx(TRUE_PREP.visual_token_s)


def test_step_records_refuses_a_json_without_every_rank(tmp_path: Path) -> None:
    counts = _counts(60, 0)
    bad = _bench_json(counts)
    del bad["timeline_ranks"]
    with pytest.raises(BenchFormatError, match="timeline_ranks"):
        step_records(bad, counts)
    bad = _bench_json(counts)
    bad["timeline_ranks"]["standard"][1][0]["ids"][0] = [60]
    with pytest.raises(BenchFormatError, match=r"standard step 0: sample ids \[60\]"):
        step_records(bad, counts)


def test_command_predicts_and_compares(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cal_counts, run_counts = _counts(240, 0), _counts(160, 1)
    by_seed = {0: cal_counts, 1: run_counts}
    cal, target = _bench_json(cal_counts), _bench_json(run_counts)
    true = CPUProfile(TRUE_STEP, TRUE_PREP, TRUE_WORKER)
    truth = predict(true, run_counts, target["params"], [0, 1])
    target["ratios"] = {
        "odb-padded/standard": truth["ratios"]["odb/standard"],
        "odb-padded/grouped_incl_length_pass": truth["ratios"]["odb/grouped, pass counted"],
        # measured 30% above what the true parameters predict: outside the target
        "odb-padded/gmt_incl_precompute": 1.3 * truth["ratios"]["odb/gmt, pass counted"],
    }
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    (tmp_path / "run.json").write_text(json.dumps(target))

    def count(n: int, seed: int, max_len: int) -> BenchSamples:
        assert by_seed[seed].n == n and max_len == 1024
        return by_seed[seed]

    argv = ["--fit-from", str(tmp_path / "cal.json"), "--predict", str(tmp_path / "run.json")]
    assert sim_fidelity.main([*argv, "--sim-seeds", "2", "--json"], count=count) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["in_sample"] and not out["within_target"]
    rows = {r["ratio"]: r for r in out["rows"]}
    assert rows["odb/standard"]["rel_err"] == pytest.approx(0.0, abs=1e-6)
    assert rows["odb/grouped, pass counted"]["rel_err"] == pytest.approx(0.0, abs=1e-6)
    assert rows["odb/gmt, pass counted"]["rel_err"] == pytest.approx(1 / 1.3 - 1, abs=1e-6)
    assert out["predicted"]["length_pass_s"] == pytest.approx(truth["length_pass_s"])
    assert out["fit"]["worker_over_pass"] == pytest.approx(1.5)
    assert sim_fidelity.main([*argv, "--sim-seeds", "2"], count=count) == 0
    text = capsys.readouterr().out
    assert "| odb/gmt, pass counted |" in text and "NOT within 15%" in text


def test_drop_warmup_fits_without_the_first_repeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A first repeat whose odb-padded first step waited 3x as long (a fresh process's
    warm-up) moves the fitted worker level; `--drop-warmup` fits the other repeats and
    recovers it. A run of one repeat is refused."""
    counts = _counts(240, 0)
    cal = _bench_json(counts)
    for summary in cal["strategies"].values():
        summary["runs"] = summary["runs"] * 2  # as the two repeats of timelines
    for rank in cal["timeline_ranks"]["odb-padded"][0]:
        rank["timeline"][0][1] *= 3.0
    (tmp_path / "cal.json").write_text(json.dumps(cal))

    def count(n: int, seed: int, max_len: int) -> BenchSamples:
        return counts

    argv = ["--fit-from", str(tmp_path / "cal.json"), "--sim-seeds", "1", "--json"]
    assert sim_fidelity.main(argv, count=count) == 0
    with_warmup = json.loads(capsys.readouterr().out)
    assert with_warmup["fit"]["worker_over_pass"] > 2.0
    assert sim_fidelity.main([*argv, "--drop-warmup"], count=count) == 0
    dropped = json.loads(capsys.readouterr().out)
    assert dropped["calibration_repeats"] == "all but the first"
    assert dropped["fit"]["worker_over_pass"] == pytest.approx(1.5)
    assert dropped["fit"]["steps"] == with_warmup["fit"]["steps"] // 2
    one = without_first_repeat(cal)
    with pytest.raises(BenchFormatError, match="1 repeat"):
        without_first_repeat(one)
