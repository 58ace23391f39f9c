"""The tail of a dynamic-sharding epoch, over every schedule of the model.

`dry_round_gap(cfg)` explores the Python model's state graph extended with one
history variable per rank: the round in which the rank ran its last real batch
so far (`RankSnapshot.round` after the `Receive` that emitted it; 0 before any).
In every complete run (all ranks done) the ranks' last rounds differ by at most
the returned gap. proofs/dynamic_sharding.md, D3: with dynamic sharding, join
mode and every sample costing the budget, the gap is at most 1 (all ranks run
dry within one round of each other); `tests/test_dynamic_tail.py` checks it,
shows it reached, and catches `DealToFirst`, which breaks it.
"""

from __future__ import annotations

from odb_core.protocol import RankMachine
from odb_core.verify.model import GlobalModel, GlobalState, ModelConfig

History = tuple[int, ...]


def dry_round_gap(cfg: ModelConfig) -> int:
    """Max over complete runs of (max_r L_r - min_r L_r), L_r the round in which
    rank r ran its last real batch (0 if it ran none)."""
    model = GlobalModel(cfg)
    start: tuple[GlobalState, History] = (model.init(), (0,) * cfg.protocol.world_size)
    seen = {start}
    stack = [start]
    gap = 0
    while stack:
        state, last = stack.pop()
        for action, nxt in model.successors(state):
            hist = last
            r = action.rank
            if action.name == "Receive" and r is not None:
                ran = nxt.step_batches[r][len(state.step_batches[r]) :]
                if any(ran):
                    hist = (*last[:r], nxt.ranks[r].round, *last[r + 1 :])
            if nxt.all_done:
                gap = max(gap, max(hist) - min(hist))
            node = (nxt, hist)
            if node not in seen:
                seen.add(node)
                stack.append(node)
    return gap


class DealToFirst(RankMachine):
    """Broken on purpose: rank 0 loads the whole of every deal and the others
    nothing. Every id is still dealt to one rank, but the deal no longer
    balances the ranks, so the tail grows past one round."""

    def _dealt_slice(self, assigned: tuple[int, ...]) -> tuple[int, int]:
        if self.rank == 0:
            return self.cursor, self.cursor + sum(assigned)
        return self.cursor, self.cursor
