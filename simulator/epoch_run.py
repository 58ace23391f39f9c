"""The state a strategy's run of one epoch shares with the others: the workload's
columns, the epoch's permutation, the pad slot, and the trainer and DataLoader
sources it builds, with the cost of a batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from odb_core.cost import BatchStats
from odb_core.cost_table import CostTable
from odb_core.sample import Sample
from simulator.dataloader import DataSource
from simulator.sim_config import SimConfig
from simulator.slots import Columns
from simulator.trainer import Slot, Trainer

Progress = Callable[[int], None]


class Run:
    """State shared by the strategy runners of one simulation."""

    def __init__(
        self,
        cfg: SimConfig,
        progress: Progress | None,
        epoch: int = 0,
        cost_table: CostTable | None = None,
    ) -> None:
        self.cfg = cfg
        self.cols = Columns(cfg.workload)
        self.world = cfg.ranks
        self.progress = progress
        self.budget = cfg.token_budget
        self.model = cfg.cost_model()
        self.cost_table = cost_table  # odb: the deal's prices (learned last epoch)
        self.learned: CostTable | None = None  # odb: the table this epoch observed
        rng = np.random.default_rng([cfg.seed, 1] if epoch == 0 else [cfg.seed, 1, epoch])
        self.perm: list[int] = rng.permutation(self.cols.n).tolist()
        pad_len = min(self.cols.length)
        self.pad_slot = Slot((), 0, pad_len, pad_len * pad_len, pad_len, 0.0, True)
        self.stalls: dict[int, list[tuple[int, float, float]]] = {}
        for r, w, at, dur in cfg.faults.stalls:
            self.stalls.setdefault(r, []).append((w, at, dur))
        self.events = 0

    def trainer(self, budget: float) -> Trainer:
        f = self.cfg.faults
        return Trainer(
            self.cfg.hardware,
            self.world,
            budget,
            self.pad_slot,
            stragglers=dict(f.stragglers),
            tail_window=self.cfg.tail_window,
            n_samples=self.cols.n,
            stop_at=f.dead_at_s if f.dead_rank is not None else float("inf"),
        )

    def source(self, r: int, order: Sequence[int], depth: int) -> DataSource:
        return DataSource(
            order, self.cols.prep, self.cfg.num_workers, depth, stalls=self.stalls.get(r, ())
        )

    def visual_of(self, ids: Sequence[int]) -> int:
        return sum(self.cols.visual[i] for i in ids)

    def cost_of(self, ids: Sequence[int], cached: bool = False) -> float:
        st = BatchStats()
        c = self.cols
        for i in ids:
            if cached:
                ln = c.cached[i]
                frac = c.text[i] / c.length[i] if c.length[i] else 1.0
                t = round(ln * frac)
                st = st.add(Sample(i, t, ln - t, c.patches[i]))
            else:
                st = st.add(Sample(i, c.text[i], c.visual[i], c.patches[i]))
        return self.model.cost(st)

    def ddp_fault(self, tr: Trainer) -> dict[str, Any] | None:
        f = self.cfg.faults
        if f.dead_rank is None:
            return None
        at = max(tr.end, f.dead_at_s)
        timeout = self.cfg.hardware.network.collective_timeout_s
        return {
            "dead_rank": f.dead_rank,
            "died_at_s": f.dead_at_s,
            "detected_by": [r for r in range(self.world) if r != f.dead_rank],
            "detected_at_s": round(at + timeout, 3) if tr.halted else None,
            "how": "DDP gradient all-reduce hangs until the NCCL collective timeout",
            "epoch_completed": not tr.halted,
        }
