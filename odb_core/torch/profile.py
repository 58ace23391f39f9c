"""The measured sample profile of a dataset: mean cost and loss tokens per sample.

It sizes what a token-budget run needs to match a fixed-batch run
(`odb_core.schedule.match_fixed_batch`, `fixed_batch_tokens`) before the loader
exists: the same seeded samples the loader's step estimate measures
(`length.cost_sample_ids`), measured the way the loader measures them.

    profile = sample_profile(dataset)          # or loader.sample_profile()
    T = match_fixed_batch(profile, batch_size=8, world_size=W)
    loader = ODBDataLoader(dataset, token_budget=..., tokens_per_update=T)
"""

from __future__ import annotations

from typing import Any

from odb_core.errors import ConfigError
from odb_core.schedule import SampleProfile
from odb_core.torch.length import cost_sample_ids
from odb_core.torch.measure import CostFn, LossTokens, LossTokensFn, measure
from odb_core.torch.source import read_sample

__all__ = ["sample_profile"]


def sample_profile(
    dataset: Any,
    *,
    cost_fn: CostFn | None = None,
    loss_tokens_fn: LossTokensFn | None = None,
    label_shift: int = 1,
    ignore_index: int = -100,
) -> SampleProfile:
    """Mean cost and loss tokens per sample of a map-style `dataset`, from a seeded
    sample of up to 256 samples (the arguments as `ODBDataLoader`'s)."""
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(
            f"sample_profile needs a sized map-style dataset; got {type(dataset).__name__}"
        )
    if len(dataset) == 0:
        raise ConfigError("sample_profile of an empty dataset")
    counter = LossTokens(loss_tokens_fn, label_shift, ignore_index)
    return SampleProfile.of(
        [
            measure(read_sample(dataset, i), i, cost_fn, counter)
            for i in cost_sample_ids(len(dataset))
        ]
    )
