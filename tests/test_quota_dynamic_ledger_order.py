"""The order of a dynamic quota pass's ledger (in-process ranks).

Each rank's ledger row (`EpochPipeline._ledger`: what its close carried, the ids
it was dealt and never read, and on rank 0 the plan ids no rank was dealt) is in
the order of the pass's plan, not of the ids: the next pass deals the carried
ids first, in that order (odb_core/torch/rounds.py). The plan is shuffled, so
an order by id would differ (the surviving mutants of `make mutants` on
`_ledger`, docs/VERIFICATION.md).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_quota_resume import fresh  # noqa: E402
from thread_ranks import on_ranks, to_the_end  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.step import StepInfo  # noqa: E402

pytestmark = pytest.mark.torch

DYN: dict[str, Any] = {"sharding": "dynamic", "buffer_size": 3}


def one_pass_and_its_plan(loader: ODBDataLoader) -> tuple[list[StepInfo], dict[str, Any]]:
    infos, state = to_the_end(loader)
    loader.__dict__["_test_plan"] = loader._plan  # the closed pass's plan
    return infos, state


@pytest.mark.parametrize("world", [1, 2])
def test_every_ledger_row_is_in_the_order_of_the_pass_plan(world: int) -> None:
    results = on_ranks(world, fresh(**DYN), one_pass_and_its_plan)
    plan = results[0].loader.__dict__["_test_plan"]
    ledgers = results[0].loader.ledgers
    assert all(r.loader.ledgers == ledgers for r in results), "one ledger on every rank"
    position = {i: k for k, i in enumerate(plan)}
    for row in ledgers:
        assert list(row) == sorted(row, key=position.__getitem__), row
    carried = [i for row in ledgers for i in row]
    assert len(carried) > 1 and carried != sorted(carried), "an id order would pass: no check"
