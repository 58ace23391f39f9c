"""Which manifest models `odb check --engine tlc|both` runs: the slow ones (minutes
each under TLC) only with --all-models or when named; tests/test_tlc.py runs every
model regardless. No Java needed."""

from __future__ import annotations

from odb_core.cli.check import select_models
from odb_core.verify import tlc
from odb_core.verify.bugs import BugVariant

MANIFEST = tlc.load_manifest()
CROSS = {"MCInductive_cross_join", "MCInductive_cross_quota", "MCInductive_cross_weak_bug"}


def test_the_cross_rank_inductive_checks_are_the_slow_models() -> None:
    slow = {m.name for m in MANIFEST if m.slow}
    assert slow >= CROSS
    assert len(slow) < len(MANIFEST) // 4, "most models stay in the default check"


def test_default_leaves_the_slow_models_out_and_names_them() -> None:
    models, skipped = select_models(MANIFEST, None, None)
    assert set(skipped) == {m.name for m in MANIFEST if m.slow} >= CROSS
    assert [m.name for m in models] == [m.name for m in MANIFEST if not m.slow]


def test_all_models_or_a_named_model_runs_the_slow_ones() -> None:
    models, skipped = select_models(MANIFEST, None, None, all_models=True)
    assert [m.name for m in models] == [m.name for m in MANIFEST] and skipped == []
    models, skipped = select_models(MANIFEST, ["MCInductive_cross_join"], None)
    assert [m.name for m in models] == ["MCInductive_cross_join"] and skipped == []
    models, _ = select_models(MANIFEST, None, BugVariant.NO_PADS)
    assert [m.bug for m in models] == [BugVariant.NO_PADS.value]


def test_the_report_names_the_models_left_out() -> None:
    from odb_core.cli.check import format_manifest

    out = {"engine": "tlc", "manifest": "m.json", "models": [], "skipped_slow": sorted(CROSS)}
    text = format_manifest(out)
    assert "--all-models runs them" in text and "MCInductive_cross_join" in text
    assert "left out" not in format_manifest({**out, "skipped_slow": []})
