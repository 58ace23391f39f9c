"""benchmarks/deal_oracle.py: the what-if deal that knows every sample's cost keeps
`assign.deal`'s pacing and places ids by true cost (docs/SIMULATOR.md, "Dynamic
sharding": the part of the gap to gmt that is the price of unknown costs)."""

from __future__ import annotations

from typing import Any
from unittest import mock

from benchmark_scripts import load_benchmark

from odb_core import assign, collective
from odb_core.collective import Contribution

ORACLE = load_benchmark("deal_oracle")


def _c(unread: int, held: int, work: int) -> Contribution:
    return Contribution(0, False, (), (), (), unread, held, work)


def test_the_oracle_deals_as_many_ids_as_the_deal_and_lifts_the_least_true_work() -> None:
    # Plan of 8 ids, 2 ranks: initial shares of 2 (ids 0,1 and 2,3). Rank 0's unread
    # id 1 is dear (100), rank 1's unread id 3 is cheap (1); the mean prices both
    # alike, the oracle knows rank 1 holds less.
    cost = [5, 100, 5, 1, 10, 10, 10, 10]
    oracle = ORACLE.OracleDeal(range(8), cost, world=2, target=4)
    g = [_c(unread=1, held=1, work=5), _c(unread=1, held=1, work=5)]
    real = assign.deal(g, 0, 4, 4)
    got = oracle(g, 0, 4, 4)
    assert sum(got) == sum(real) == 4
    assert got == (0, 4)  # rank 0's true work (105) is over any level rank 1 reaches
    assert oracle(g, 0, 4, 4) == got  # one answer per gathered list (every rank asks)
    assert list(oracle.dealt[1]) == [3, 4, 5, 6, 7]


def test_a_simulated_epoch_under_the_oracle_is_exactly_once_with_the_real_pacing() -> None:
    totals: list[tuple[int, int]] = []
    real_deal = assign.deal

    def counting(oracle: Any) -> Any:
        def deal(g: Any, steps: int, plan_left: int, target: int) -> tuple[int, ...]:
            out = oracle(g, steps, plan_left, target)
            totals.append((sum(out), sum(real_deal(g, steps, plan_left, target))))
            return out  # type: ignore[no-any-return]

        return deal

    cls = ORACLE.OracleDeal
    with mock.patch.object(ORACLE, "OracleDeal", lambda *a: counting(cls(*a))):
        row = ORACLE.run_cell("mmmix", 16, 0, 2000, oracle=True)
    assert totals and all(got == want for got, want in totals)
    assert row["steps"] >= 1 and row["tail_steps"] >= 0  # run_cell raised on lost/dup ids
    assert collective.deal is real_deal  # the patch is undone
