"""A peer lost while the ranks construct their loaders: the survivor raises
ODBPeerError naming it (not torch's raw DistNetworkError), within peer_timeout."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import gloo_ranks

from odb_core import ODBDataLoader
from odb_core.errors import ODBPeerError


def construct(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    if rank == spec["lost"]:
        time.sleep(spec["after"])
        os._exit(1)
    data = [{"input_ids": [1, 2, 3]} for _ in range(20)]
    t0 = time.monotonic()
    try:
        ODBDataLoader(data, token_budget=8, collate_fn=len, peer_timeout=spec["timeout"])
    except ODBPeerError as exc:
        took = time.monotonic() - t0
        return {
            "raised": "ODBPeerError",
            "message": str(exc),
            "ranks": list(exc.ranks),
            "took": took,
        }
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


@pytest.mark.parametrize("lost", [0, 1])
def test_a_peer_lost_during_construction_is_named(tmp_path: Path, lost: int) -> None:
    spec = {"lost": lost, "after": 0.0, "timeout": 6.0}
    res = gloo_ranks.launch(f"{__name__}:construct", 2, spec, tmp_path)
    got = res[1 - lost]
    assert got is not None and got["ok"], got
    assert got["raised"] == "ODBPeerError", got
    assert got["ranks"] == [lost], got
    assert f"rank {lost}" in got["message"].split(":")[1], got
