"""`odb bench --model`: a tiny real run (2 gloo ranks, DDP, a 2-layer Llama) and the
option errors. Figures are not asserted: only the bench's own checks and its schema."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
from guards import HANG_GUARD_S

pytest.importorskip("transformers")

from odb_core.bench import model_bench

ODB = [sys.executable, "-c", "import sys; from odb_core.cli import main; sys.exit(main())"]
# --timeout: the bench's limit on a run of its ranks, a hang guard here (tests/guards.py):
# 50 s was reached under load (two pytest workers beside other jobs, load ~9).
TINY = [
    "--model", "llama-tiny", "--samples", "48", "--max-len", "64", "--budget", "256",
    "--repeats", "1", "--eval-samples", "4", "--workers", "0", "--timeout", str(HANG_GUARD_S),
]  # fmt: skip
ROW_KEYS = {
    "samples_per_s", "samples_per_s_incl_precompute", "tokens_per_s", "padding",
    "steps_per_rank", "pad_steps", "peak_rss_mb", "data_wait_s", "collate_s",
    "allgather_stall_s", "train_loss_per_token", "held_out_loss", "equal_steps",
    "exactly_once", "precompute_s", "runs",
}  # fmt: skip


def test_tiny_run_json(tmp_path: object) -> None:
    strategies = "standard,grouped,gmt,trl-packed,odb-padded,odb-packed"
    cmd = [*ODB, "bench", *TINY, "--json", "--strategies", strategies]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["ok"] is True
    assert set(r["strategies"]) == set(strategies.split(","))
    for name, row in r["strategies"].items():
        assert set(row) >= ROW_KEYS, name
        assert row["samples_per_s"] > 0
    for name in ("odb-padded", "odb-packed"):
        row = r["strategies"][name]
        assert row["equal_steps"] and row["exactly_once"]
        assert len(set(row["steps_per_rank"])) == 1
        assert row["runs"][0]["unique_ids"] == 48
    assert r["strategies"]["odb-packed"]["padding"] == 0.0
    trl = r["strategies"]["trl-packed"]  # TRL's BFD rows: no padding, every id, pass counted
    assert trl["padding"] == 0.0 and trl["precompute_s"] > 0
    assert trl["runs"][0]["unique_ids"] == 48
    assert r["strategies"]["gmt"]["precompute_s"] > 0
    assert {
        "odb-padded/standard",
        "odb-packed/gmt",
        "odb-padded/gmt_incl_precompute",
        "odb-padded/grouped",
        "odb-packed/grouped_incl_length_pass",
        "grouped/standard",
        "odb-packed/trl-packed",
        "odb-packed/trl-packed_incl_pass",
    } <= set(r["ratios"])
    assert r["strategies"]["grouped"]["precompute_s"] > 0
    assert "quality" not in r
    assert set(r["timeline_rank0_last_repeat"]) == set(r["strategies"])
    # every rank's timeline with its step ids (simulator/bench_fit.py)
    for name, repeats in r["timeline_ranks"].items():
        assert len(repeats) == r["params"]["repeats"]
        ranks = repeats[-1]
        assert ranks[0]["timeline"] == r["timeline_rank0_last_repeat"][name]
        assert len(ranks) == r["params"]["ranks"]
        assert all(len(x["ids"]) == len(x["timeline"]) for x in ranks)
        if name.startswith("odb-"):  # each id once
            steps = [(t, s) for x in ranks for t, s in zip(x["timeline"], x["ids"], strict=True)]
            assert sorted(i for t, s in steps if not t[6] for i in s) == list(range(48)), name


def test_early_form_reaches_the_loader_and_keeps_every_id_once() -> None:
    """`--early-form N`: odb-core's loaders run with it (static sharding, as early
    forms need), the report says so, and every id is still trained once."""
    cmd = [*ODB, "bench", *TINY, "--json", "--strategies", "standard,odb-packed",
           "--early-form", "4"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout)["strategies"]["odb-packed"]
    assert row["loader"]["early_form"] == 4
    assert (
        row["loader"]["sharding"] == "static" and "early_form=4" in row["loader"]["sharding_reason"]
    )
    assert row["equal_steps"] and row["exactly_once"] and row["runs"][0]["unique_ids"] == 48


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--model", "llama-huge"], "unknown --model 'llama-huge'; expected one of llama-tiny"),
        (["--model", "llama-tiny", "--max-len", "512", "--budget", "256"], "under the longest"),
        (["--model", "llama-tiny", "--strategies", "fast"], "unknown strategy 'fast'"),
        (
            ["--model", "llama-tiny", "--epochs", "2"],
            "--epochs and --regime finetune need --quality",
        ),
        (["--model", "llama-tiny", "--regime", "finetune"], "need --quality"),
        (
            ["--model", "llama-tiny", "--quality", "--lr", "nan"],
            "--lr=nan must be a finite number > 0",
        ),
        (
            ["--model", "llama-tiny", "--strategies", "standard,odb-parity"],
            "strategy 'odb-parity' is a learning-rate recipe: it needs --quality",
        ),
        (
            ["--model", "llama-tiny", "--quality", "--strategies", "standard,odb-ref"],
            "odb-ref has no schedule on run progress",
        ),
        (
            ["--model", "llama-tiny", "--quality", "--strategies", "grouped,odb-padded"],
            "--quality needs 'standard'",
        ),
        (
            ["--model", "qwen3-vl-tiny", "--strategies", "standard,trl-packed"],
            "TRL refuses packing for vision datasets",
        ),
    ],
)
def test_bad_options_fail_clearly(
    args: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from odb_core.cli import main

    assert main(["bench", *args]) == 2  # rejected before any rank starts
    assert match in capsys.readouterr().err


def test_early_form_under_one_names_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    from odb_core.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--model", "llama-tiny", "--early-form", "0"])
    assert "--early-form: '0' must be >= 1" in capsys.readouterr().err


def test_unknown_regime_names_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    from odb_core.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--model", "llama-tiny", "--quality", "--regime", "warm"])
    assert exc.value.code == 2
    assert "--regime: invalid choice: 'warm'" in capsys.readouterr().err


def test_budget_check_respects_oversize() -> None:
    params = {
        "model": "llama-tiny", "max_len": 512, "budget": 256, "oversize": "solo",
        "eval_samples": 4, "strategies": ["standard"],
    }  # fmt: skip
    assert model_bench.validate(params) == ["standard"]
    with pytest.raises(ValueError, match="under the longest sample"):
        model_bench.validate({**params, "oversize": "error"})


def test_gmt_plan_cuts_at_the_budget_and_deals_every_id() -> None:
    from odb_core.bench.gmt import gmt_plan
    from odb_core.bench.workload import lengths

    lens = lengths(200, 256, seed=3)
    plan = gmt_plan(lens, 512, world=2, seed=0)
    batches = [b for rank in plan for b in rank]
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(len(b) * max(lens[i] for i in b) <= 512 for b in batches)
    assert abs(len(plan[0]) - len(plan[1])) <= 1


def test_quality_smoke_ratios_follow_the_curves() -> None:
    from odb_core.bench.quality import time_to_target

    strategies = (
        "standard,grouped,odb-padded,odb-max-samples,odb-max-samples-packed,odb-sqrt-lr,odb-parity"
    )
    cmd = [*ODB, "bench", *TINY, "--quality", "--epochs", "2", "--regime", "finetune",
           "--pretrain-samples", "16", "--strategies", strategies, "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["ok"] is True
    q = r["quality"]
    assert q["regime"] == "finetune" and q["epochs"] == 2
    assert set(q["strategies"]) == set(strategies.split(","))
    std = r["strategies"]["standard"]["runs"][0]["curve"]
    target, std_time = std[-1][2], std[-1][0]
    for name, row in q["strategies"].items():
        assert {"time_to_target_ratio", "heldout_gap", "time_to_target_ratio_vs_grouped",
                "heldout_gap_vs_grouped", "reached"} <= set(row)  # fmt: skip
        curve = r["strategies"][name]["runs"][0]["curve"]
        assert curve[0][0] == 0.0 and curve[0][1] == 0  # the start, before any update
        assert len(curve) >= 3  # checkpoints along the run (every 1/4 epoch, or the step after)
        assert all(a[1] < b[1] and a[0] <= b[0] for a, b in itertools.pairwise(curve))
        assert curve[-1][1] >= 2 * 48  # both epochs' samples consumed
        t = time_to_target(curve, target)
        assert row["time_to_target_ratio"] == (None if t is None else pytest.approx(t / std_time))
        assert row["heldout_gap"] == pytest.approx(curve[-1][2] / target - 1)
        if name.startswith("odb-"):
            assert r["strategies"][name]["equal_steps"] and r["strategies"][name]["exactly_once"]
    parity = r["strategies"]["odb-parity"]["runs"][0]
    assert parity["updates"] < parity["steps_per_rank"][0]  # windows span several steps
    # At most B samples a step under a budget of B longest samples: the fixed run's
    # steps (one window holds each rank's shard, so every batch but the last is full).
    capped, fixed = (r["strategies"][n]["runs"][0] for n in ("odb-max-samples", "standard"))
    assert capped["steps_per_rank"] == fixed["steps_per_rank"]
    assert capped["updates"] == capped["steps_per_rank"][0]
    assert (
        r["strategies"]["odb-padded"]["runs"][0]["steps_per_rank"][0] < fixed["steps_per_rank"][0]
    )
    # Packed (dynamic sharding, window 64): at most B samples a step still, so no
    # fewer steps than the fixed run's (packed rows without the cap hold more).
    packed = r["strategies"]["odb-max-samples-packed"]["runs"][0]
    assert packed["steps_per_rank"][0] >= fixed["steps_per_rank"][0]


def test_trl_bfd_rows_hold_every_id_once_under_the_budget() -> None:
    from odb_core.bench.trl_packing import trl_bfd_plan
    from odb_core.bench.workload import lengths

    lens = lengths(200, 256, seed=3)
    plan, took = trl_bfd_plan(lens, 512, world=2, seed=0)
    rows = [row for rank in plan for row in rank]
    assert took >= 0 and abs(len(plan[0]) - len(plan[1])) <= 1
    assert sorted(i for row in rows for i in row) == list(range(200))
    assert all(sum(lens[i] for i in row) <= 512 for row in rows)
    # best-fit decreasing fills rows: within one row of the token lower bound
    assert len(rows) <= -(-sum(lens) // 512) + 1
    with pytest.raises(ValueError, match="sample 7 has 600 tokens > the budget 512"):
        trl_bfd_plan([*lens[:7], 600, *lens[8:]], 512, world=2, seed=0)
