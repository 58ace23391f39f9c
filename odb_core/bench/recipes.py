"""The odb-core strategies of `odb bench --model`, as typed recipes.

`odb-padded` / `odb-packed` train at the fixed run's learning rate on larger,
fewer updates. The documented ways to keep quality when batches grow
(docs/TRAINERS.md, "Token-aware learning rate, and matching a fixed batch"):
`odb-max-samples` (padded) and `odb-max-samples-packed` keep the fixed run's
steps (`max_samples=B` under the fixed run's budget: at most B samples a step,
formed from a window sorted by cost, so a pass-free `group_by_length`);
`odb-sqrt-lr` / `odb-linear-lr` keep the large updates and scale each update's
rate by its window's loss tokens over the fixed batch's (`TokenScaling`, square
root or linear); `odb-parity` keeps the fixed run's updates
(`tokens_per_update=match_fixed_batch(...)`) with a per-step budget of one longest
sample, so a step's loss tokens stay below the window's target.
In `--quality` runs every odb recipe's schedule is `ProgressLR` (it ends on the
last update); the recipes with a token rule or parity run only there.
"""

from __future__ import annotations

from dataclasses import dataclass

from odb_core.schedule import TokenRule


@dataclass(frozen=True)
class Recipe:
    cost_model: str  # "padded" or "packed" (the loader's cost_model)
    packed: bool  # pack_collate (varlen attention) instead of pad_collate
    lr_tokens: TokenRule | None = None  # token-aware rate against the fixed batch's tokens
    parity: bool = False  # tokens_per_update = the fixed batch's, budget = one longest sample
    max_samples_fixed_batch: bool = False  # max_samples = B, under the fixed run's budget

    @property
    def quality_only(self) -> bool:
        return self.lr_tokens is not None or self.parity


RECIPES: dict[str, Recipe] = {
    "odb-padded": Recipe("padded", packed=False),
    "odb-packed": Recipe("packed", packed=True),
    "odb-max-samples": Recipe("padded", packed=False, max_samples_fixed_batch=True),
    "odb-max-samples-packed": Recipe("packed", packed=True, max_samples_fixed_batch=True),
    "odb-sqrt-lr": Recipe("padded", packed=False, lr_tokens=TokenRule.SQRT),
    "odb-linear-lr": Recipe("padded", packed=False, lr_tokens=TokenRule.LINEAR),
    "odb-parity": Recipe("padded", packed=False, parity=True),
}
