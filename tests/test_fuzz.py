"""`odb fuzz`: adversarial schedules keep every guarantee; broken machines are caught."""

from __future__ import annotations

import json

import pytest

from odb_core.cli import main
from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import Budget
from odb_core.protocol import RankMachine
from odb_core.sample import Sample
from odb_core.verify.bugs import BugVariant
from simulator.fuzz import (
    Schedule,
    fuzz,
    hypothesis_search,
    random_schedule,
    replay,
    run_schedule,
)


def test_random_schedules_keep_every_guarantee() -> None:
    report = fuzz(32, 120, seed=7, search_examples=0)
    out = report.to_json()
    assert out["ok"] and out["violations"] == 0 and out["schedules"] == 120
    for key in ("steps", "rounds"):
        w = out["worst"][key]
        assert 0 < w["value"] <= w["bound"]
    assert out["worst"]["tail_steps"]["value"] <= out["worst"]["tail_steps"]["bound"]


def test_schedules_cover_the_adversarial_space() -> None:
    scheds = [random_schedule(s, 64) for s in range(300)]
    assert {s.world for s in scheds} >= {1, 2, 64}
    assert {s.config.mode for s in scheds} == set(Mode)
    assert {s.order for s in scheds} == {"shuffled", "ascending", "descending", "alternating"}
    assert any(min(s.speeds) <= 0.01 for s in scheds)  # stragglers
    assert any(not shard for s in scheds for shard in s.shards)  # empty ranks
    assert {s.config.oversize.value for s in scheds} == {"error", "solo", "truncate"}
    assert len({s.config.cost_model.name for s in scheds}) == 4


def test_schedules_replay_exactly() -> None:
    a, b = replay(11, 64), replay(11, 64)
    assert a.summary() == b.summary() and a.ok


def test_world_size_1024() -> None:
    seed = next(s for s in range(200) if random_schedule(s, 1024).world == 1024)
    o = run_schedule(random_schedule(seed, 1024))
    assert o.ok, o.violations
    assert o.schedule.world == 1024 and o.steps <= o.steps_bound


def test_the_steps_bound_is_reached() -> None:
    # one sample per batch (max_samples=1): a rank with n samples needs n steps
    shards = [[Sample(i, 1) for i in range(5)], [Sample(5, 1)], []]
    cfg = ProtocolConfig(world_size=3, budget=Budget(4, max_samples=1), buffer_size=1)
    o = run_schedule(Schedule(1, 3, shards, cfg, [1.0, 0.5, 0.2], 0.5, 0.5, 0.5, "given"))
    assert o.ok, o.violations
    assert o.steps == o.steps_bound == 5 and o.rounds <= o.rounds_bound
    assert o.pads == 4 + 5 and o.tail == 5


def test_hypothesis_search_steers_towards_the_bound() -> None:
    outcomes = hypothesis_search(8, 40, "steps", seed=3)
    assert outcomes and all(o.ok for o in outcomes)
    best = max(o.steps / o.steps_bound for o in outcomes if o.steps_bound)
    assert 0.5 <= best <= 1.0
    tails = hypothesis_search(8, 30, "tail", seed=3)
    assert max(o.tail for o in tails) > 0


@pytest.mark.parametrize("bug", [b for b in BugVariant if b.passes == 1 and not b.dynamic])
def test_every_broken_machine_is_caught(bug: BugVariant) -> None:
    report = fuzz(8, 40, seed=0, machine=bug.machine, search_examples=5)
    assert not report.ok, f"{bug.value} was not caught"
    tag = {
        "DeadlockFreedom": ("DeadlockFreedom", "ProtocolError", "CollectiveAlignment"),
        "NoLoss": ("IdentityCoverage", "QuotaClosure"),
    }.get(bug.violates, (bug.violates,))
    messages = [m for v in report.violations for m in v["violations"]]
    assert any(any(t in m for t in tag) for m in messages), (bug.violates, messages[:3])


def test_correct_machine_is_the_default() -> None:
    o = run_schedule(random_schedule(5, 16), RankMachine)
    assert o.ok


def test_cli_fuzz_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--ranks", "16", "--schedules", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["violations"] == 0 and out["max_ranks"] == 16
    assert out["worst"]["steps"]["value"] <= out["worst"]["steps"]["bound"]
    assert set(out["by_origin"]) == {"random", "hypothesis:steps", "hypothesis:tail"}


def test_cli_fuzz_human_bug_and_replay(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--ranks", "8", "--schedules", "20", "--search-examples", "0"]) == 0
    assert "all guarantees hold" in capsys.readouterr().out
    args = ["fuzz", "--ranks", "8", "--schedules", "20", "--bug", "no-pads", "--json"]
    assert main(args) == 0  # the broken variant must be caught
    out = json.loads(capsys.readouterr().out)
    assert out["bug"]["caught"] and out["violations"] > 0
    assert main(["fuzz", "--ranks", "8", "--replay", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"]["seed"] == 3


def test_cli_fuzz_rejects_bad_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "2048"):
        with pytest.raises(SystemExit) as exc:
            main(["fuzz", "--ranks", bad])
        assert exc.value.code == 2
        assert repr(bad) in capsys.readouterr().err


def test_dynamic_sharding_schedules_keep_every_guarantee() -> None:
    from odb_core.config import Sharding

    report = fuzz(64, 40, seed=0, search_examples=0, sharding=Sharding.DYNAMIC)
    assert report.ok, report.violations[:1]
    broken = fuzz(
        16,
        20,
        seed=0,
        machine=BugVariant.DEAL_OVERLAPS.machine,
        search_examples=0,
        sharding=Sharding.DYNAMIC,
    )
    messages = [m for v in broken.violations for m in v["violations"]]
    assert any("NoDuplicate" in m for m in messages), messages[:3]
