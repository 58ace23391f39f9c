"""proofs/dynamic_sharding.md, D3: with dynamic sharding (join mode, every sample
costing the budget) all ranks run their last real batch within one round of
each other, over every schedule of the model; the bound is reached; a deal that
does not balance (DealToFirst) is caught; and without the premise it fails."""

from __future__ import annotations

from dataclasses import replace

import pytest

from odb_core.config import Mode, ProtocolConfig, Sharding
from odb_core.cost import Budget
from odb_core.verify.model import ModelConfig, dynamic_model, round_robin_shards
from odb_core.verify.tail import DealToFirst, dry_round_gap

BUDGET = 4


def _config(
    costs: tuple[int, ...], world: int, k: int, m: int, target: int, dynamic: bool = True
) -> ModelConfig:
    p = ProtocolConfig(
        world_size=world,
        budget=Budget(BUDGET),
        buffer_size=k,
        max_steps_per_round=m,
        mode=Mode.JOIN,
        sharding=Sharding.DYNAMIC if dynamic else Sharding.STATIC,
        assign_target=target if dynamic else None,
    )
    return dynamic_model(p, costs) if dynamic else ModelConfig(p, round_robin_shards(costs, world))


# Every sample costs the budget (D3's premise): W = 2, 3; n = 3..6; K, M = 1, 2; T <= 2.
GRID = [
    (n, w, k, m, t)
    for w in (2, 3)
    for n in range(3, 7)
    for k in (1, 2)
    for m in (1, 2)
    for t in (1, 2)
]


def test_all_ranks_run_dry_within_one_round_of_each_other() -> None:
    gaps = {g: dry_round_gap(_config((BUDGET,) * g[0], *g[1:])) for g in GRID}
    assert max(gaps.values()) <= 1, {g: v for g, v in gaps.items() if v > 1}
    # ... and the bound is reached: a run where one rank's last batch is a round later.
    assert 1 in gaps.values()


def test_a_deal_that_does_not_balance_is_caught() -> None:
    cfg = replace(_config((BUDGET,) * 6, 3, 1, 1, 1), machine=DealToFirst)
    assert dry_round_gap(cfg) == 3
    assert dry_round_gap(_config((BUDGET,) * 6, 3, 1, 1, 1)) <= 1


@pytest.mark.parametrize(
    ("costs", "world", "k", "m", "target"),
    # Configured target 5: the deal target (assign.deal_target) is 3 for these
    # plans of 5-6 ids on 2 ranks.
    [((3, 1, 3, 3, 1, 2), 2, 3, 3, 5), ((3, 3, 4, 2, 1), 2, 3, 1, 5)],
)
def test_without_the_premise_the_gap_can_be_two_rounds(
    costs: tuple[int, ...], world: int, k: int, m: int, target: int
) -> None:
    """Unequal costs: the deal prices unread ids at the gathered mean and batches
    pack several samples, so D3's argument does not apply (nor its bound)."""
    assert _config(costs, world, k, m, target).protocol.target == 3
    assert dry_round_gap(_config(costs, world, k, m, target)) == 2
