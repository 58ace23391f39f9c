"""The checked models reach the protocol's real behaviours.

Each manifest model that TLC checks with graph equality is explored by the
Python checker (the same state graph, tests/test_conformance.py), and the
behaviours of `behaviours.BEHAVIOURS` are looked for in it: rounds of several
steps, offers that differ across ranks, more ready batches than M, a pad
beside a real batch, a mid-round quota cut, an oversized sample, binding
sample and patch caps, visual tokens. If the models degenerate, this fails.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
from behaviours import BEHAVIOURS, reached

from odb_core.verify import tlc
from odb_core.verify.checker import check

CONFORMANCE = [m for m in tlc.load_manifest() if m.conformance]


@lru_cache(maxsize=1)
def reached_by_model() -> dict[str, set[str]]:
    out = {}
    for m in CONFORMANCE:
        cfg = m.model_config()
        report = check(cfg, keep_graph=True)
        assert report.ok and report.graph is not None, m.name
        out[m.name] = reached(cfg, report.graph)
    return out


@pytest.mark.parametrize("behaviour", list(BEHAVIOURS))
def test_behaviour_is_reached_in_a_checked_model(behaviour: str) -> None:
    where = [name for name, got in reached_by_model().items() if behaviour in got]
    assert where, f"no model with graph equality reaches: {behaviour}"


def test_the_quota_cut_and_a_round_of_several_steps_meet_in_one_quota_model() -> None:
    both = {"a mid-round quota cut", "k>=2 steps in a round"}
    assert any(both <= got for got in reached_by_model().values())


def test_the_detectors_can_say_no() -> None:
    """The smallest join model (a window of 1) reaches none of the round shapes."""
    got = reached_by_model()["MCjoin_w2_n4_k1"]
    for behaviour in (
        "k>=2 steps in a round",
        "len(ready) > M",
        "a pad beside a real batch in a round",
        "a mid-round quota cut",
        "an oversized sample",
        "visual tokens",
    ):
        assert behaviour not in got
