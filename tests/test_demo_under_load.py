"""Pinned TLC figures are a function of the model alone, not of the machine's
load; and the TLC section of `odb demo` passes.

Before `-lncheck final`, TLC checked liveness on a timer, so a loaded machine
reported a different distinct-state count for `MCno_fairness_bug` (416 instead
of the pinned 501) and the demo failed. The liveness models (the two whose
counterexample is a liveness violation, and an ok model whose Termination
holds) are run again here with every CPU kept busy by another job; the other
models' verdicts are safety violations or ok, found by TLC's breadth-first
search on one worker whatever the speed (tests/test_tlc.py also asserts that
every run passes `-lncheck final`).

The demo's TLC section runs once, on the TLC results of the session's manifest
run (tests/test_tlc.py `manifest_results`: the same models, run by the same
`run_manifest` with the same options, each checked against its pins there): its
Python side, the state-graph comparison and the trace replay run for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from test_tlc import BY_NAME, manifest_results, require_tlc

from odb_core.cli import check
from odb_core.verify import tlc

pytestmark = [pytest.mark.tlc, pytest.mark.slow]

#: What a timer could cut short: liveness checked on a violating and on an ok model.
LIVENESS = ["MCno_fairness_bug", "MCsilent_stop_termination_bug", "MCjoin_w2_n4_k1"]


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def test_the_liveness_models_are_as_pinned_beside_a_cpu_hog(cpu_hog: None) -> None:
    require_tlc()
    liveness = {m.name for m in BY_NAME.values() if m.expected == "liveness" and not m.slow}
    assert liveness <= set(LIVENESS), "a new liveness model: run it here too"
    out = check.check_manifest([BY_NAME[name] for name in LIVENESS], engine="tlc")
    assert out["all_as_pinned"], [(r["name"], r["diffs"]) for r in out["models"]]
    results = {r["name"]: (r["result"], r["distinct_states"]) for r in out["models"]}
    assert results["MCno_fairness_bug"] == ("liveness", 501), results
    assert results["MCjoin_w2_n4_k1"] == ("ok", 393), results


def test_the_demos_tlc_section_is_as_pinned(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    require_tlc()
    session = manifest_results()
    ran: list[str] = []

    def session_results(models: list[tlc.ManifestModel], **kw: object) -> dict[str, object]:
        ran.extend(m.name for m in models)
        return {m.name: session[m.name] for m in models}

    monkeypatch.setattr(tlc, "run_manifest", session_results)
    ok = check.demo_section()
    out = capsys.readouterr().out
    assert "MCno_fairness_bug" in ran and "MCInductive_join" in ran
    assert "all as pinned" in out, out
    assert "DIFFERS" not in out, out
    assert "graphs_equal: true" in out and "accepted" in out, out
    assert ok, out
