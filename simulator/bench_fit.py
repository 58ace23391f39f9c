"""Fit the CPU profile (`simulator.cpu_profile`) to one measured bench run.

Input: `odb bench --model qwen3-vl-tiny --json` (its `timeline_ranks`: every
rank's per-step timeline and step ids, every repeat) and the bench's samples
counted by `simulator.bench_workload`.

Step time, by least squares over every step of every strategy. A DDP step ends
for all ranks together, when the last rank's backward has finished:

    t_done = max_r (t_got_r + rank_s(batch_r)) + step_s

so the time from the last rank's batch arriving to the step's end is
`y = step_s + max_r (delta_r + rank_s(batch_r))`, delta_r = t_got_r - max t_got
(<= 0). The max makes it piecewise linear: fit with the slowest rank per step
fixed, recompute which rank is slowest under the fit, repeat until it no longer
changes.

Preprocessing: a per-sample profile gives its shape (seconds = a + b * visual
tokens, least squares over the data set's samples, timed one at a time in this
process); its level is set by the run's own length pass (grouped's and gmt's,
medians over the repeats), which preprocesses every sample of a rank's half in
the rank process: prep = k * (a, b), k = measured pass / the profile's pass.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from odb_core.config import default_buffer_size
from odb_core.cost import CostKind
from simulator.bench_workload import BenchSamples
from simulator.cpu_profile import STEP_FEATURES, CPUProfile, PrepModel, StepModel

PASS_STRATEGIES = ("grouped", "gmt")  # the strategies whose length pass the bench times


class BenchFormatError(ValueError):
    """A bench JSON without what the fit needs, naming what is missing."""


@dataclass(frozen=True)
class RankStep:
    delta_s: float  # when this rank's batch arrived, relative to the last rank's (<= 0)
    real: int
    computed: int
    visual: int


@dataclass(frozen=True)
class StepRecord:
    strategy: str
    y_s: float  # last batch arrival to the step's end
    ranks: tuple[RankStep, ...]


@dataclass(frozen=True)
class StepFit:
    model: StepModel
    steps: int
    iterations: int
    rms_s: float
    r2: float
    per_strategy_rel_err: dict[str, float]  # |sum predicted - sum measured| / measured
    stderr: tuple[float, ...]  # per coefficient (STEP_FEATURES order)
    held_at_zero: tuple[str, ...]  # terms whose unconstrained fit was negative


def rank_timelines(result: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(strategy, every rank's timeline and step ids) for every repeat of the run."""
    by_name = result.get("timeline_ranks")
    if not isinstance(by_name, dict) or not by_name:
        raise BenchFormatError(
            "the bench JSON has no 'timeline_ranks' (every rank's timeline and step ids): "
            "rerun `odb bench --model qwen3-vl-tiny --json` with this version"
        )
    return [(name, ranks) for name, repeats in by_name.items() for ranks in repeats]


def without_first_repeat(result: dict[str, Any]) -> dict[str, Any]:
    """The run less its first repeat, every strategy's (its summaries and every rank's
    timeline): in a fresh rank process the first repeat is a warm-up (on the quiet
    box of docs/SIMULATOR.md every strategy but the first ran 10-30% slower in it)."""
    rank_timelines(result)  # refuses a run without them
    by_name: dict[str, list[Any]] = result["timeline_ranks"]
    counts = {len(repeats) for repeats in by_name.values()}
    if min(counts) < 2:
        raise BenchFormatError(
            f"the run has {min(counts)} repeat(s): dropping the first leaves nothing to fit"
        )
    out = dict(result)
    out["timeline_ranks"] = {name: repeats[1:] for name, repeats in by_name.items()}
    out["strategies"] = {
        name: {**summary, "runs": summary.get("runs", [])[1:]}
        for name, summary in result["strategies"].items()
    }
    return out


def step_records(result: dict[str, Any], counts: BenchSamples) -> list[StepRecord]:
    """Every step of every strategy in every repeat of the run, all ranks."""
    fields = result.get("timeline_fields")
    want = ["t_s", "wait_s", "compute_s", "real_tokens", "computed_tokens", "samples", "is_pad"]
    if fields != want:
        raise BenchFormatError(f"timeline_fields {fields!r}: expected {want!r}")
    visual = counts.visual
    out: list[StepRecord] = []
    for name, per_rank in rank_timelines(result):
        lens = {len(r["timeline"]) for r in per_rank}
        if len(lens) != 1 or any(len(r["ids"]) != len(r["timeline"]) for r in per_rank):
            raise BenchFormatError(f"{name}: ranks' timelines differ in length {sorted(lens)}")
        for s in range(lens.pop()):
            got, done, rows = [], [], []
            for r in per_rank:
                t, wait, comp, real, computed, _, _ = r["timeline"][s]
                ids = r["ids"][s]
                if any(not 0 <= i < counts.n for i in ids):
                    raise BenchFormatError(
                        f"{name} step {s}: sample ids {ids} outside the {counts.n} counted"
                    )
                got.append(t + wait)
                done.append(t + wait + comp)
                rows.append((int(real), int(computed), int(sum(int(visual[i]) for i in ids))))
            last = max(got)
            ranks = tuple(
                RankStep(g - last, real, computed, vis)
                for g, (real, computed, vis) in zip(got, rows, strict=True)
            )
            out.append(StepRecord(name, statistics.fmean(done) - last, ranks))
    return out


def _features(rank: RankStep) -> list[float]:
    return [1.0, rank.real, max(0, rank.computed - rank.real), rank.visual]


def _slowest(record: StepRecord, coef: np.ndarray | None) -> int:
    """The rank whose batch ends last under `coef` (None: the most computed tokens)."""

    def end(k: int) -> float:
        r = record.ranks[k]
        if coef is None:
            return float(r.computed)
        return r.delta_s + float(np.dot(coef[1:], _features(r)[1:]))

    return max(range(len(record.ranks)), key=end)


def fit_steps(
    records: Sequence[StepRecord],
    features: Sequence[str] = STEP_FEATURES,
    max_iterations: int = 50,
) -> StepFit:
    """Least squares of the step model over `records`, using only `features` (the
    others held at 0: a deliberately reduced fit, for the tests)."""
    if len(records) < len(STEP_FEATURES):
        raise BenchFormatError(f"{len(records)} steps: too few to fit {len(STEP_FEATURES)} terms")
    cols = [STEP_FEATURES.index(f) for f in features]
    y = np.array([r.y_s for r in records])
    slowest = [_slowest(r, None) for r in records]
    coef = np.zeros(len(STEP_FEATURES))
    iterations = 0
    while iterations < max_iterations:
        iterations += 1
        x = np.array(
            [
                [_features(r.ranks[k])[c] for c in cols]
                for r, k in zip(records, slowest, strict=True)
            ]
        )
        shift = np.array([r.ranks[k].delta_s for r, k in zip(records, slowest, strict=True)])
        sol, se, zero = nonnegative_lstsq(x, y - shift)
        coef = np.zeros(len(STEP_FEATURES))
        coef[cols] = sol
        stderr = np.zeros(len(STEP_FEATURES))
        stderr[cols] = se
        held = tuple(features[i] for i in zero)
        new = [_slowest(r, coef) for r in records]
        if new == slowest:
            break
        slowest = new
    model = StepModel(*(float(c) for c in coef))
    pred = np.array([predict_step(model, r) for r in records])
    resid = y - pred
    ss_tot = float(((y - y.mean()) ** 2).sum())
    per: dict[str, float] = {}
    for name in dict.fromkeys(r.strategy for r in records):
        idx = [i for i, r in enumerate(records) if r.strategy == name]
        meas = float(y[idx].sum())
        per[name] = abs(float(pred[idx].sum()) - meas) / meas if meas > 0 else 0.0
    return StepFit(
        model,
        len(records),
        iterations,
        float(np.sqrt((resid**2).mean())),
        1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0,
        per,
        tuple(float(s) for s in stderr),
        held,
    )


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Least squares with every coefficient >= 0 (a cost is never negative): the
    most negative term is held at 0 and the rest refitted, until none is negative.
    Returns the coefficients, their standard errors (0 for held terms) and the
    held columns."""
    free = list(range(x.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        worst = int(np.argmin(sol))
        if sol[worst] >= 0 or len(free) == 1:
            break
        free.pop(worst)
    coef = np.zeros(x.shape[1])
    coef[free] = sol
    se = np.zeros(x.shape[1])
    dof = len(y) - len(free)
    if dof > 0:
        sub = x[:, free]
        sigma2 = float(((y - sub @ sol) ** 2).sum()) / dof
        se[free] = np.sqrt(np.clip(np.diag(sigma2 * np.linalg.pinv(sub.T @ sub)), 0.0, None))
    return coef, se, [i for i in range(x.shape[1]) if i not in free]


def predict_step(model: StepModel, record: StepRecord) -> float:
    return model.step_s + max(
        r.delta_s + model.rank_s(r.real, r.computed, r.visual) for r in record.ranks
    )


def measured_pass_s(result: dict[str, Any]) -> float:
    """The run's length pass: median over the repeats of grouped's and gmt's."""
    passes = [
        float(run["precompute_s"])
        for name in PASS_STRATEGIES
        for run in result["strategies"].get(name, {}).get("runs", [])
    ]
    if not passes:
        raise BenchFormatError(f"the bench JSON has no timed length pass ({PASS_STRATEGIES})")
    return float(statistics.median(passes))


def pass_s(prep: PrepModel, visual: np.ndarray, world: int) -> float:
    """A length pass: rank r preprocesses samples r, r + W, ...; the slowest rank's time."""
    per = prep.sample_s + prep.visual_token_s * visual.astype(np.float64)
    return max(float(per[r::world].sum()) for r in range(world))


def fit_prep(counts: BenchSamples, measured_pass: float, world: int) -> tuple[PrepModel, float]:
    """Shape from the per-sample profile, level from the measured pass; returns the
    model and the level factor k."""
    x = np.column_stack([np.ones(counts.n), counts.visual.astype(np.float64)])
    (a, b), _, _ = nonnegative_lstsq(x, counts.prep_s)
    shape = PrepModel(float(a), float(b))
    k = measured_pass / pass_s(shape, counts.visual, world)
    return PrepModel(k * shape.sample_s, k * shape.visual_token_s), k


def worker_level(result: dict[str, Any], counts: BenchSamples, shape: PrepModel) -> float | None:
    """The worker's level against `shape`, from odb-padded's first step: before it,
    each rank's one worker preprocessed the rank's first window (min(window, shard)
    samples of its shard), which the rank waited for. Least squares of one factor
    over the ranks and repeats; None without odb-padded or with several workers."""
    ranks = [r for name, rs in rank_timelines(result) if name == "odb-padded" for r in rs]
    if not ranks or int(result["params"]["workers"]) != 1:
        return None
    window = result["params"].get("buffer_size") or default_buffer_size(CostKind.PADDED)
    waits, model = [], []
    for r in ranks:
        shard = [i for ids in r["ids"] for i in ids]
        per = shape.sample_s + shape.visual_token_s * counts.visual[shard].astype(np.float64)
        waits.append(float(r["timeline"][0][1]))
        model.append(min(int(window), len(shard)) * float(per.mean()))
    m = np.asarray(model)
    return float(np.dot(m, waits) / np.dot(m, m))


def fit_profile(result: dict[str, Any], counts: BenchSamples) -> tuple[CPUProfile, dict[str, Any]]:
    """The CPU profile fitted to one run, and what the fit reports about itself."""
    fit = fit_steps(step_records(result, counts))
    world = int(result["params"]["ranks"])
    prep, level = fit_prep(counts, measured_pass_s(result), world)
    worker = worker_level(result, counts, prep)
    worker_prep = (
        prep if worker is None else PrepModel(worker * prep.sample_s, worker * prep.visual_token_s)
    )
    p = result["params"]
    source = f"odb bench --model {p['model']} --samples {p['samples']} --seed {p['seed']}"
    report = {
        "steps": fit.steps,
        "iterations": fit.iterations,
        "rms_s": fit.rms_s,
        "r2": fit.r2,
        "per_strategy_rel_err": fit.per_strategy_rel_err,
        "stderr": dict(zip(STEP_FEATURES, fit.stderr, strict=True)),
        "held_at_zero": list(fit.held_at_zero),
        "prep_level_factor": level,
        "measured_pass_s": measured_pass_s(result),
        "worker_over_pass": worker,
    }
    return CPUProfile(fit.model, prep, worker_prep, source=source), report
