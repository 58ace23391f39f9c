"""The workload as columns, a step's trainer slot, and the aborted-epoch report:
shared by the engine's strategies and the `odb-ref` comparator."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from odb_core.sample import Sample
from simulator.trainer import Slot
from simulator.workloads import Workload


class Columns:
    """The workload as Python lists (fast scalar access in the hot loops)."""

    def __init__(self, w: Workload) -> None:
        self.text: list[int] = w.text.tolist()
        self.visual: list[int] = w.visual.tolist()
        self.patches: list[int] = w.patches.tolist()
        self.length: list[int] = w.length.tolist()
        self.cached: list[int] = w.cached.tolist()
        self.prep: list[float] = w.prep_s.tolist()
        self.n = w.n

    def sample(self, i: int) -> Sample:
        return Sample(i, self.text[i], self.visual[i], self.patches[i])


def make_slot(
    lengths: Sequence[int], ids: tuple[int, ...], padded: bool, cost: float, visual: int = 0
) -> Slot:
    real = sum(lengths)
    if padded:
        mx = max(lengths)
        compute = len(lengths) * mx
        return Slot(ids, real, compute, compute * mx, compute, cost, visual=visual)
    sq = sum(x * x for x in lengths)
    return Slot(ids, real, real, sq, real, cost, visual=visual)


def mark_aborted(out: dict[str, Any]) -> None:
    """An epoch cut short by a dead rank has no meaningful loss count: the ids it did
    not reach are reported as `undelivered_ids` instead."""
    f = out.get("fault")
    if f and not f.get("epoch_completed", True):
        out["undelivered_ids"] = out["lost_ids"]
        out["lost_ids"] = None
