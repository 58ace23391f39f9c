"""The time-to-quality arithmetic of `odb bench --model --quality` on synthetic
curves (pure), and the `grouped` baseline's plan (HF's sampler, Accelerate's
sharding)."""

from __future__ import annotations

import math

import pytest

from odb_core.bench.quality import summarise, time_to_target


def test_time_to_target_interpolates_between_checkpoints() -> None:
    curve = [(0.0, 0, 5.0), (10.0, 100, 3.0), (20.0, 200, 2.0)]
    assert time_to_target(curve, 3.0) == 10.0  # reached exactly at a checkpoint
    assert time_to_target(curve, 2.5) == pytest.approx(15.0)  # half-way 3.0 -> 2.0
    assert time_to_target(curve, 4.0) == pytest.approx(5.0)
    assert time_to_target(curve, 5.0) == 0.0  # the start is already there
    assert time_to_target(curve, 1.9) is None  # never reached


def test_time_to_target_takes_the_first_crossing() -> None:
    curve = [(0.0, 0, 5.0), (1.0, 1, 2.0), (2.0, 2, 4.0), (3.0, 3, 1.0)]
    assert time_to_target(curve, 3.0) == pytest.approx(2.0 / 3.0)


def _curves() -> dict[str, list[list[tuple[float, float, float]]]]:
    # standard ends at 2.0, 2.2, 2.4 after 100 s; grouped reaches them at 50 s;
    # fast at 20 s; slow never in two seeds of three
    standard = [[(0.0, 0, 6.0), (100.0, 1, t)] for t in (2.0, 2.2, 2.4)]
    grouped = [[(0.0, 0, 6.0), (50.0, 1, t), (60.0, 2, t - 0.1)] for t in (2.0, 2.2, 2.4)]
    fast = [[(0.0, 0, 6.0), (20.0, 1, t), (30.0, 2, t * 1.01)] for t in (2.0, 2.2, 2.4)]
    slow = [
        [(0.0, 0, 6.0), (40.0, 1, 1.9)],
        [(0.0, 0, 6.0), (40.0, 1, 2.3)],
        [(0.0, 0, 6.0), (40.0, 1, 2.6)],
    ]
    return {"standard": standard, "grouped": grouped, "fast": fast, "slow": slow}


def test_summary_ratios_are_what_the_curves_say() -> None:
    q = summarise(_curves())
    assert q["standard"]["time_to_target_ratio"] == pytest.approx(1.0)
    assert q["grouped"]["time_to_target_ratio"] == pytest.approx(0.5)
    assert q["fast"]["time_to_target_ratio"] == pytest.approx(0.2)
    assert q["fast"]["time_to_target_ratio_vs_grouped"] == pytest.approx(0.4)
    assert q["standard"]["time_to_target_ratio_vs_grouped"] == pytest.approx(2.0)
    assert q["fast"]["heldout_gap"] == pytest.approx(0.01)
    gaps = q["grouped"]["heldout_gap_per_seed"]
    assert gaps == pytest.approx([-0.1 / 2.0, -0.1 / 2.2, -0.1 / 2.4])
    assert q["grouped"]["heldout_gap"] == pytest.approx(-0.1 / 2.2)
    assert q["fast"]["heldout_gap_vs_grouped"] == pytest.approx(2.2 * 1.01 / 2.1 - 1)


def test_a_strategy_that_misses_the_target_in_most_seeds_has_no_time() -> None:
    q = summarise(_curves())
    assert q["slow"]["reached"] == 1
    reached_at = 40.0 * (6.0 - 2.0) / (6.0 - 1.9)  # interpolated between 0 s and 40 s
    assert q["slow"]["time_to_target_ratio_per_seed"][0] == pytest.approx(reached_at / 100.0)
    assert q["slow"]["time_to_target_ratio_per_seed"][1:] == [None, None]
    assert q["slow"]["time_to_target_ratio"] is None
    assert q["slow"]["time_to_target_ratio_vs_grouped"] is None
    assert q["slow"]["heldout_gap"] == pytest.approx(2.3 / 2.2 - 1)


def test_a_target_met_before_any_update() -> None:
    flat = [[(0.0, 0, 2.0), (10.0, 1, 2.0)]]
    late = [[(0.0, 0, 3.0), (10.0, 1, 2.0)]]
    q = summarise({"standard": flat, "grouped": flat, "late": late})
    assert q["grouped"]["time_to_target_ratio_vs_grouped"] == 1.0  # 0 s / 0 s
    assert q["late"]["time_to_target_ratio"] == pytest.approx(1.0)
    assert q["late"]["time_to_target_ratio_vs_grouped"] is None  # 10 s / 0 s


def test_summary_needs_the_same_seeds_everywhere() -> None:
    curves = _curves()
    curves["fast"] = curves["fast"][:2]
    with pytest.raises(ValueError, match="every strategy needs 3 seeds"):
        summarise(curves)


def test_grouped_plan_is_hf_order_dealt_to_consecutive_ranks() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    from odb_core.bench.grouped import grouped_plan
    from odb_core.bench.workload import lengths

    lens = lengths(203, 256, seed=1)
    plan = grouped_plan(lens, 4, world=2, seed=7)
    gen = torch.Generator()
    gen.manual_seed(7)
    order = get_length_grouped_indices(lens, 4, generator=gen)
    hf_batches = [order[i : i + 4] for i in range(0, len(order), 4)]
    assert len(plan[0]) == len(plan[1]) == math.ceil(len(hf_batches) / 2)
    dealt = [b for pair in zip(plan[0], plan[1], strict=True) for b in pair]
    full = [b for b in hf_batches if len(b) == 4]
    assert dealt[: len(full)] == full  # batch k to rank k % 2, HF's own order
    assert all(len(b) == 4 for rank in plan for b in rank)  # the tail wraps round
    assert set(i for rank in plan for b in rank for i in b) == set(range(203))
