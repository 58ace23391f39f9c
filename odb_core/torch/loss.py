"""Applying a step's loss scale to the loss."""

from __future__ import annotations

import torch

from odb_core.protocol import StepInfo


def scale_loss(loss: torch.Tensor, info: StepInfo) -> torch.Tensor:
    """`loss` (this rank's mean over its batch: per token with the default `tokens`
    normalisation, per sample with `samples`) times `info.loss_scale`.

    loss_scale = W * local / global, so after DDP/FSDP average the gradients over
    the W ranks the update is exactly that of the global mean over every real
    token (sample) of the step. A pad step has scale 0: its backward still runs,
    so the gradient collectives line up, but it contributes nothing.
    """
    return loss * info.loss_scale
