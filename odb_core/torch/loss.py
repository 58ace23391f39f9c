"""Deprecated: `scale_loss(loss, info)` is `odb_core.scaled_loss(info, loss)`."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from odb_core.torch.meta import apply_scale


def scale_loss(loss: torch.Tensor, info: Any) -> torch.Tensor:
    """Deprecated alias of `scaled_loss(info, loss)` (arguments the other way round;
    now with its pad-step rule: a step of scale 0 gives 0 even for a NaN loss)."""
    warnings.warn(
        "odb_core.scale_loss(loss, info) is deprecated: use odb_core.scaled_loss(info, loss) "
        "(step metadata first)",
        DeprecationWarning,
        stacklevel=2,
    )
    return apply_scale(loss, float(info.loss_scale))
