"""`odb bench --model`: a tiny real run (2 gloo ranks, DDP, a 2-layer Llama) and the
option errors. Figures are not asserted: only the bench's own checks and its schema."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from odb_core.torch import model_bench

ODB = [sys.executable, "-c", "import sys; from odb_core.cli import main; sys.exit(main())"]
TINY = [
    "--model", "llama-tiny", "--samples", "48", "--max-len", "64", "--budget", "256",
    "--repeats", "1", "--eval-samples", "4", "--workers", "0", "--timeout", "50",
]  # fmt: skip
ROW_KEYS = {
    "samples_per_s", "samples_per_s_incl_precompute", "tokens_per_s", "padding",
    "steps_per_rank", "pad_steps", "peak_rss_mb", "data_wait_s", "collate_s",
    "allgather_stall_s", "train_loss_per_token", "held_out_loss", "equal_steps",
    "exactly_once", "precompute_s", "runs",
}  # fmt: skip


def test_tiny_run_json(tmp_path: object) -> None:
    cmd = [*ODB, "bench", *TINY, "--json", "--strategies", "standard,gmt,odb-padded,odb-packed"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["ok"] is True
    assert set(r["strategies"]) == {"standard", "gmt", "odb-padded", "odb-packed"}
    for name, row in r["strategies"].items():
        assert set(row) >= ROW_KEYS, name
        assert row["samples_per_s"] > 0
    for name in ("odb-padded", "odb-packed"):
        row = r["strategies"][name]
        assert row["equal_steps"] and row["exactly_once"]
        assert len(set(row["steps_per_rank"])) == 1
        assert row["runs"][0]["unique_ids"] == 48
    assert r["strategies"]["odb-packed"]["padding"] == 0.0
    assert r["strategies"]["gmt"]["precompute_s"] > 0
    assert {"odb-padded/standard", "odb-packed/gmt", "odb-padded/gmt_incl_precompute"} <= set(
        r["ratios"]
    )
    assert set(r["timeline_rank0_last_repeat"]) == set(r["strategies"])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--model", "llama-huge"], "unknown --model 'llama-huge'; expected one of llama-tiny"),
        (["--model", "llama-tiny", "--max-len", "512", "--budget", "256"], "under the longest"),
        (["--model", "llama-tiny", "--strategies", "fast"], "unknown strategy 'fast'"),
    ],
)
def test_bad_options_fail_clearly(
    args: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from odb_core.cli import main

    assert main(["bench", *args]) == 2  # rejected before any rank starts
    assert match in capsys.readouterr().err


def test_budget_check_respects_oversize() -> None:
    params = {
        "model": "llama-tiny", "max_len": 512, "budget": 256, "oversize": "solo",
        "eval_samples": 4, "strategies": ["standard"],
    }  # fmt: skip
    assert model_bench.validate(params) == ["standard"]
    with pytest.raises(ValueError, match="under the longest sample"):
        model_bench.validate({**params, "oversize": "error"})


def test_gmt_plan_cuts_at_the_budget_and_deals_every_id() -> None:
    lens = model_bench.lengths(200, 256, seed=3)
    plan = model_bench._gmt_plan(lens, 512, world=2, seed=0)
    batches = [b for rank in plan for b in rank]
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(len(b) * max(lens[i] for i in b) <= 512 for b in batches)
    assert abs(len(plan[0]) - len(plan[1])) <= 1
