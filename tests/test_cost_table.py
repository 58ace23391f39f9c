"""The cost table learned online (odb_core/cost_table.py) and the deals it prices:
codes, state round trip and validation, and pricing that never touches safety."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odb_core.assign import Pricing
from odb_core.collective import Contribution
from odb_core.config import Mode, ProtocolConfig, Sharding
from odb_core.cost import Budget
from odb_core.cost_table import CostTable, combine, decode, encode, record
from odb_core.errors import ConfigError, ResumeStateError
from odb_core.protocol import RankMachine
from odb_core.verify.checker import check
from odb_core.verify.model import dynamic_model


def test_codes_are_one_byte_within_three_percent() -> None:
    assert encode(0) == 1 and decode(1) == 0
    for cost in (1, 7, 100, 4096, 65_000, 1_000_000):
        code = encode(cost)
        assert 1 <= code <= 255
        assert abs(decode(code) - cost) <= 0.03 * cost + 1
    assert encode(10**9) == 255  # the top code holds what is above 2^21
    with pytest.raises(ValueError, match="not a non-negative"):
        encode(-1)


def test_ranks_tables_combine_into_the_epochs() -> None:
    a = record({0: 10, 3: 500}, 5)
    b = record({1: 40, 4: 2, 99: 7}, 5)  # 99 is no dataset index: not recorded
    table = CostTable(combine([a, b]))
    assert [table.price(i) for i in range(5)] == [
        decode(encode(10)),
        decode(encode(40)),
        None,
        decode(encode(500)),
        decode(encode(2)),
    ]
    assert table.seen == 4 and table.price(7) is None and table.price(-1) is None
    with pytest.raises(ValueError, match="cannot be combined"):
        combine([a, bytes(4)])


def test_ten_million_ids_fit_twenty_megabytes() -> None:
    import random

    table = CostTable(random.Random(0).randbytes(10_000_000))  # incompressible: the worst
    state = table.to_state()
    assert len(table.codes) <= 20_000_000 and len(state["codes"]) <= 20_000_000
    assert CostTable.from_state(state, len(table)) == table


def test_a_table_from_disk_is_validated() -> None:
    table = CostTable(record({0: 5, 2: 9}, 4))
    good = table.to_state()
    assert CostTable.from_state(good) == table
    bad = [
        ({**good, "crc32": good["crc32"] ^ 1}, "crc32"),
        ({**good, "ids": 5}, "holds 4 codes, not ids=5"),
        ({**good, "ids": -1}, "ids=-1"),
        ({**good, "codes": "!!"}, "corrupt"),
        ({**good, "extra": 1}, "keys ids, codes, crc32"),
        ("table", "must be a mapping"),
    ]
    for state, match in bad:
        with pytest.raises(ResumeStateError, match=match):
            CostTable.from_state(state)
    with pytest.raises(ResumeStateError, match="dataset has 7 ids"):
        CostTable.from_state(good, 7)
    # A zip bomb: far more codes than `ids` are refused without inflating them all.
    import base64

    bomb = base64.b64encode(zlib.compress(bytes(10_000_000))).decode()
    with pytest.raises(ResumeStateError, match="codes, not ids=4"):
        CostTable.from_state({"ids": 4, "codes": bomb, "crc32": 0})


def test_a_table_needs_dynamic_sharding() -> None:
    with pytest.raises(ConfigError, match="needs sharding='dynamic'"):
        ProtocolConfig(world_size=1, budget=Budget(4), cost_table=CostTable(b"\x01"))


def _c(offered: int = 0, unread: int = 0, held: int = 0, work: int = 0) -> Contribution:
    return Contribution(offered, False, (1,) * offered, (1,) * offered, (1,) * offered,
                        unread, held, work)  # fmt: skip


def test_a_priced_deal_places_dear_ids_apart_and_deals_the_same_count() -> None:
    from odb_core.assign import deal

    # Two ranks holding the same work; the next four ids cost 10, 10, 1, 1. Priced,
    # rank 0 takes one dear id and rank 1 the other three (its slice follows).
    contributions = [_c(held=2, work=8), _c(held=2, work=8)]
    prices = [10, 10, 1, 1]
    priced = deal(contributions, 0, 4, 4, Pricing(((0, 0), (0, 0)), prices.__getitem__, 4))
    mean = deal(contributions, 0, 4, 4)
    assert sum(priced) == sum(mean) == 4
    assert priced == (1, 3) and mean == (2, 2)


def _table_config(
    world: int, mode: Mode, table: CostTable, window: int = 2, steps: int = 2
) -> ProtocolConfig:
    return ProtocolConfig(
        world_size=world,
        budget=Budget(4),
        buffer_size=window,
        max_steps_per_round=steps,
        mode=mode,
        quota=3 if mode is Mode.QUOTA else None,
        sharding=Sharding.DYNAMIC,
        assign_target=window,
        cost_table=table,
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    costs=st.lists(st.integers(1, 4), min_size=3, max_size=8),
    world=st.integers(2, 3),
    mode=st.sampled_from([Mode.JOIN, Mode.QUOTA]),
    codes=st.binary(max_size=10),
    window=st.integers(2, 3),
    steps=st.integers(1, 2),
)
def test_any_pricing_keeps_exactly_once_alignment_and_the_bound(
    costs: list[int], world: int, mode: Mode, codes: bytes, window: int, steps: int
) -> None:
    """D1-D3 over every schedule with an arbitrary (adversarial) table: any codes,
    any length (ids it does not cover are unseen), stale or wrong."""
    cfg = _table_config(world, mode, CostTable(codes), window, steps)
    r = check(dynamic_model(cfg, costs))
    assert r.ok, [v.to_json() for v in r.violations]


class RankLocalPricing(RankMachine):
    """Broken: each rank prices by what it alone believes (here, its rank scales the
    prices), so the ranks' deals differ and the ids each loads are no longer one
    split of the plan: pricing that changes the ids dealt, not only where they go."""

    def pricing(self, contributions: Sequence[Contribution]) -> Pricing | None:
        p = super().pricing(contributions)
        if p is None:
            return None
        skew = 1 + 50 * self.rank
        return p._replace(upcoming=lambda i: skew * (i % 3 + 1))


def test_pricing_from_anything_but_agreed_state_is_caught() -> None:
    costs = (1, 3, 1, 1, 3, 1, 2, 1)
    table = CostTable(record(dict(enumerate(costs)), len(costs)))
    cfg = _table_config(2, Mode.JOIN, table, window=3, steps=1)
    assert check(dynamic_model(cfg, costs)).ok
    r = check(dynamic_model(cfg, costs, machine=RankLocalPricing))
    assert not r.ok and "NoLoss" in {v.property for v in r.violations}


def test_a_table_that_prices_exactly_keeps_the_tail_within_one_round() -> None:
    """D3's premise (every sample costs the budget) with a table that knows it: the
    priced deal keeps every rank's last real batch within one round of the others,
    over the 64 configurations of tests/test_dynamic_tail.py."""
    from dataclasses import replace

    from test_dynamic_tail import BUDGET, GRID, _config

    from odb_core.verify.tail import dry_round_gap

    gaps = []
    for n, *rest in GRID:
        cfg = _config((BUDGET,) * n, *rest)
        table = CostTable(record(dict.fromkeys(range(n), BUDGET), n))
        assert table.price(0) == BUDGET
        gaps.append(dry_round_gap(replace(cfg, protocol=replace(cfg.protocol, cost_table=table))))
    assert max(gaps) == 1  # reached, never exceeded
