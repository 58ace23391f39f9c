"""tools/mutation_score.py: the score `make mutants` prints, from mutmut's result files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import mutation_score


def write_meta(root: Path, module: str, codes: dict[str, int | None]) -> None:
    path = root / f"{module}.meta"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"exit_code_by_key": codes}), encoding="utf-8")


@pytest.fixture
def run(tmp_path: Path) -> Path:
    write_meta(
        tmp_path / "mutants",
        "odb_core/a.py",
        {
            "odb_core.a.x_f__mutmut_1": 1,
            "odb_core.a.x_f__mutmut_2": 0,
            "odb_core.a.x_f__mutmut_3": 36,
        },
    )
    write_meta(
        tmp_path / "mutants",
        "odb_core/torch/b.py",
        {
            "odb_core.torch.b.x_g__mutmut_1": 0,
            "odb_core.torch.b.x_g__mutmut_2": None,
            "odb_core.torch.b.x_g__mutmut_3": 33,
        },
    )
    return tmp_path


def test_score_sets_equivalent_mutants_apart_and_counts_timeouts_as_kills(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    eq = run / "eq.txt"
    eq.write_text(
        "# header\n\nodb_core.a.x_f__mutmut_2 the sort order never matters\n", encoding="utf-8"
    )
    code = mutation_score.main(
        ["--mutants", str(run / "mutants"), "--equivalent", str(eq), "--survivors"]
    )
    out = capsys.readouterr().out
    assert code == 0
    # killed 1 + timeout 1 of: those, survivor b_1, no-tests b_3 (b_2 not run, a_2 equivalent)
    assert (
        "mutation score: 2 of 4 non-equivalent mutants killed = 50.0% (1 equivalent, 1 not run)"
        in out
    )
    assert "survivors:\n  odb_core.torch.b.x_g__mutmut_1\n" in out + "\n"
    assert "odb_core.a.x_f__mutmut_2" not in out.split("survivors:")[1]


def test_a_stale_equivalent_entry_fails_the_run(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    eq = run / "eq.txt"
    eq.write_text(
        "odb_core.a.x_f__mutmut_1 said equivalent, but killed\n"
        "odb_core.a.x_gone__mutmut_9 renamed away\n",
        encoding="utf-8",
    )
    assert mutation_score.main(["--mutants", str(run / "mutants"), "--equivalent", str(eq)]) == 1
    err = capsys.readouterr().err
    assert (
        "odb_core.a.x_f__mutmut_1 (killed)" in err
        and "odb_core.a.x_gone__mutmut_9 (not generated)" in err
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [("odb_core.a.x_f__mutmut_2\n", "has no reason"), ("n why\nn why again\n", "listed twice")],
)
def test_an_equivalent_list_without_reasons_or_with_repeats_is_refused(
    run: Path, text: str, message: str
) -> None:
    eq = run / "eq.txt"
    eq.write_text(text, encoding="utf-8")
    with pytest.raises(SystemExit, match=message):
        mutation_score.main(["--mutants", str(run / "mutants"), "--equivalent", str(eq)])


def test_no_results_is_an_error_that_says_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="run `make mutants` first"):
        mutation_score.main(["--mutants", str(tmp_path)])
