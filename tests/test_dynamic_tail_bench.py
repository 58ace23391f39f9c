"""benchmarks/dynamic_tail.py over two epochs (issue 32, item 6): under real torchrun
the second epoch's dynamic deals are priced by the table the ranks learned in the
first, and every epoch of every run is checked for lost and duplicated ids.
Timings are reported, never asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmark_scripts import load_benchmark

pytest.importorskip("torch")

dynamic_tail = load_benchmark("dynamic_tail")


def _log(rank: int, epochs: list[list[list[int]]], seen: int | None) -> dict[str, Any]:
    return {
        "rank": rank,
        "world": 2,
        "epochs": [
            {
                "t0": 0.0,
                "t_done": 1.0,
                "table_seen_after": seen,
                "rows": [
                    {"step": k, "pad": not ids, "ids": ids, "tokens": 4 * len(ids), "t_end": 0.5}
                    for k, ids in enumerate(steps)
                ],
            }
            for steps in epochs
        ],
    }


def test_facts_are_per_epoch_and_a_duplicate_names_its_epoch(tmp_path: Path) -> None:
    good = [[[0, 1], [2]], [[0], [1], [2]]]
    other = [[[3], []], [[3], [], []]]
    for rank, epochs in enumerate((good, other)):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(_log(rank, epochs, 4)))
    facts = dynamic_tail.facts(tmp_path, 2, 4)
    assert [f["epoch_steps"] for f in facts] == [2, 3]
    assert [f["priced_ids"] for f in facts] == [0, 4]
    assert facts[1]["tail_steps"] == 2 and facts[1]["real_batches"] == [3, 1]
    dup = [[[3], []], [[3], [], [2]]]  # id 2 twice in the second epoch
    (tmp_path / "rank1.json").write_text(json.dumps(_log(1, dup, 4)))
    with pytest.raises(dynamic_tail.RunFailed, match=r"epoch 1: lost ids \[\] \(0\), duplicated"):
        dynamic_tail.facts(tmp_path, 2, 4)


@pytest.mark.procs
def test_two_epochs_under_torchrun_price_the_second_by_the_learned_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--repeats", "1", "--samples", "64", "--ranks", "2", "--json"]
    dynamic_tail.main(argv)
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["epochs"] == 2
    runs = {r["sharding"]: r for r in out["runs"]}
    assert [e["priced_ids"] for e in runs["dynamic"]["epochs"]] == [0, 64]
    assert [e["priced_ids"] for e in runs["static"]["epochs"]] == [0, 0]
    for run in runs.values():
        # every epoch ran, each checked for 0 lost, 0 duplicated and equal steps
        assert [e["epoch"] for e in run["epochs"]] == [0, 1]
        assert all(sum(e["tokens"]) > 0 for e in run["epochs"])


def test_bad_options_name_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        dynamic_tail.main(["--epochs", "0"])
    assert "--epochs=0 must be >= 1" in capsys.readouterr().err
