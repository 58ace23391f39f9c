"""The constants TLC checks each generated manifest model with, read back from the
committed spec/MC*.tla and .cfg files and compared with the manifest entry itself
(not through `spec_constants`, which wrote them).

A wrong constant can keep a model's state count and depth (another budget, loss
tokens, window length or quota often gives a graph of the same size), so the pins
of tests/test_tlc.py pass; without this check only the graph comparison of
tests/test_conformance.py (a full TLC run) would notice. No Java needed.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from odb_core.verify import tlc

MODELS = [d for d in json.loads((tlc.spec_dir() / "manifest.json").read_text())["models"]]
GENERATED = [d for d in MODELS if d.get("generated", True)]


def expected_constants(d: dict[str, Any]) -> dict[str, Any]:
    """DGAP's constants as the manifest entry states them: sample i goes to rank i mod W,
    costs include visual tokens, loss tokens default to the text tokens."""
    m = d["model"]
    costs = list(m["costs"])
    n, world = len(costs), m["world_size"]
    visual = m.get("visual") or [0] * n
    dynamic = m.get("sharding", "static") == "dynamic"
    return {
        "W": world,
        "Budget": m.get("budget", 4),
        "MaxSamples": m.get("max_samples") or 0,
        "MaxPatches": m.get("max_patches") or 0,
        "CostModel": m.get("cost_model", "packed"),
        "K": m["buffer_size"],
        "M": m.get("max_steps_per_round", 2),
        "Mode": m.get("mode", "join"),
        "Quota": m.get("quota") or 0,
        "Deterministic": bool(m.get("deterministic", False)),
        "AccumSteps": m.get("grad_accum_steps") or 1,
        "TokensPerUpdate": m.get("tokens_per_update") or 0,
        "Shard": [[i for i in range(n) if i % world == r] for r in range(world)],
        "SampleLen": costs,
        "SampleLoss": list(m["loss"])
        if m.get("loss") is not None
        else [c - v for c, v in zip(costs, visual, strict=True)],
        "SamplePatches": list(m.get("patches") or [0] * n),
        "Dynamic": dynamic,
        "Target": m["assign_target"] if dynamic else 0,
        "EarlyForm": m.get("early_form") or 0,
        "AnyPlacement": bool(m.get("any_placement", False)),
        "AnyInitialSplit": bool(m.get("any_initial_split", False)),
        "Plan": list(range(n)) if dynamic else [],
        "Carried": sorted(m.get("carried") or []),
        **({"Bug": d["bug"]} if d.get("bug") else {}),
    }


def plain(v: Any) -> Any:
    v = tlc.parse_value(v) if isinstance(v, str) else v
    if isinstance(v, frozenset | set):
        return sorted(plain(x) for x in v)
    if isinstance(v, tuple | list):
        return [plain(x) for x in v]
    return v


def committed_constants(name: str) -> dict[str, Any]:
    """The constants of spec/<name>.cfg, with the MC definitions of spec/<name>.tla."""
    spec = tlc.spec_dir()
    cfg = (spec / f"{name}.cfg").read_text()
    tla = (spec / f"{name}.tla").read_text()
    block = cfg.split("CONSTANTS\n", 1)[1]
    out: dict[str, Any] = {}
    for line in block.splitlines():
        if not line.startswith("    "):
            break
        key, op, value = line.split(maxsplit=2)
        if op == "<-":
            body = re.search(
                rf"^{value} == \[x \\in 0 \.\. \d+ \|-> (<<.*>>)\[x \+ 1\]\]$", tla, re.M
            ) or re.search(rf"^{value} == (.*)$", tla, re.M)  # a plain value: Plan, Carried
            assert body, f"{name}: no definition of {value}"
            out[key] = plain(body.group(1))
        elif key != "NoValue":
            out[key] = plain(value)
    return out


@pytest.mark.parametrize("d", GENERATED, ids=[d["name"] for d in GENERATED])
def test_committed_constants_are_the_manifest_entry(d: dict[str, Any]) -> None:
    got, want = committed_constants(d["name"]), expected_constants(d)
    assert got == want, {k: (got.get(k), want[k]) for k in want if got.get(k) != want[k]}
