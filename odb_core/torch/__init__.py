"""PyTorch adapters: `ODBDataLoader`, the gloo transport, loss scaling, in-band step
metadata, resumable state.

Importing this subpackage imports torch; `import odb_core` alone does not.
"""

from __future__ import annotations

from odb_core.torch.collate import (
    check_packed_model,
    pack_collate,
    pad_collate,
    use_packed_attention,
)
from odb_core.torch.loader import ODBDataLoader
from odb_core.torch.loss import scale_loss
from odb_core.torch.meta import (
    STEP_META_KEY,
    StepMeta,
    causal_lm_loss,
    pop_step_meta,
    scaled_loss,
    step_meta,
)
from odb_core.torch.profile import sample_profile
from odb_core.torch.schedule import ProgressLR
from odb_core.torch.source import SampleLoadError
from odb_core.torch.state import merge_states
from odb_core.torch.vlm import MRopeIndex, VLMPackCollate, vlm_pack_collate, vlm_pad_collate

__all__ = [
    "STEP_META_KEY",
    "MRopeIndex",
    "ODBDataLoader",
    "ProgressLR",
    "SampleLoadError",
    "StepMeta",
    "VLMPackCollate",
    "causal_lm_loss",
    "check_packed_model",
    "merge_states",
    "pack_collate",
    "pad_collate",
    "pop_step_meta",
    "sample_profile",
    "scale_loss",
    "scaled_loss",
    "step_meta",
    "use_packed_attention",
    "vlm_pack_collate",
    "vlm_pad_collate",
]
