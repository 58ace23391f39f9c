"""Time to quality from held-out loss curves (pure; no torch).

A curve is one run's checkpoints `(train_wall_s, global_samples, held_out_loss)`,
in order, the first at 0 s before any update. The target of a seed is the
baseline's (standard's) final held-out loss in that seed; a strategy's time to
it is the first crossing, interpolated linearly in time between the checkpoints
either side. A strategy that never reaches it has no time (None), and counts as
infinitely slow in the median over seeds: the median of 3 seeds is a time only
if at least 2 reached the target.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

Point = tuple[float, float, float]
Curve = Sequence[Point]


def time_to_target(curve: Curve, target: float) -> float | None:
    """Train wall time at which `curve` first reaches held-out loss <= `target`."""
    prev: Point | None = None
    for point in curve:
        t, _, loss = point
        if loss <= target:
            if prev is None or prev[2] == loss:
                return t
            t0, _, l0 = prev
            return t0 + (t - t0) * (l0 - target) / (l0 - loss)
        prev = point
    return None


def _median(values: Sequence[float | None]) -> float | None:
    m = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(m) else float(m)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b <= 0:  # the baseline was at the target before any update
        return 1.0 if a <= 0 else None
    return a / b


def summarise(
    curves: dict[str, list[list[Point]]], base: str = "standard", alt: str = "grouped"
) -> dict[str, dict[str, object]]:
    """Per strategy: `time_to_target_ratio` (time to `base`'s final loss / `base`'s
    wall time; `_vs_<alt>`: / `alt`'s time to the same target) and `heldout_gap`
    (final loss / `base`'s final - 1; `_vs_<alt>` likewise), medians over seeds
    (seed i of every strategy is paired with seed i of the baselines), with the
    per-seed values."""
    seeds = len(curves[base])
    if any(len(c) != seeds for c in curves.values()):
        raise ValueError(f"every strategy needs {seeds} seeds: {[len(c) for c in curves.values()]}")
    targets = [curves[base][i][-1][2] for i in range(seeds)]
    base_time = [curves[base][i][-1][0] for i in range(seeds)]
    alt_time = (
        [time_to_target(curves[alt][i], targets[i]) for i in range(seeds)]
        if alt in curves
        else None
    )
    out: dict[str, dict[str, object]] = {}
    for name, runs in curves.items():
        times = [time_to_target(runs[i], targets[i]) for i in range(seeds)]
        ratio = [_ratio(times[i], base_time[i]) for i in range(seeds)]
        gap = [runs[i][-1][2] / targets[i] - 1.0 for i in range(seeds)]
        row: dict[str, object] = {
            "time_to_target_s": times,
            "time_to_target_ratio": _median(ratio),
            "time_to_target_ratio_per_seed": ratio,
            "reached": sum(t is not None for t in times),
            "heldout_gap": float(statistics.median(gap)),
            "heldout_gap_per_seed": gap,
            "final_held_out_loss": float(statistics.median(r[-1][2] for r in runs)),
            "train_wall_s": float(statistics.median(r[-1][0] for r in runs)),
        }
        if alt_time is not None:
            vs_alt = [_ratio(times[i], alt_time[i]) for i in range(seeds)]
            alt_gap = [runs[i][-1][2] / curves[alt][i][-1][2] - 1.0 for i in range(seeds)]
            row[f"time_to_target_ratio_vs_{alt}"] = _median(vs_alt)
            row[f"time_to_target_ratio_vs_{alt}_per_seed"] = vs_alt
            row[f"heldout_gap_vs_{alt}"] = float(statistics.median(alt_gap))
        out[name] = row
    return out
