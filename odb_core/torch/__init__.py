"""PyTorch adapters: `ODBDataLoader`, the gloo transport, loss scaling, in-band step
metadata, resumable state.

Importing this subpackage imports torch; `import odb_core` alone does not.
"""

from __future__ import annotations

import importlib
from typing import Any

from odb_core import api
from odb_core.torch.collate import check_packed_model as check_packed_model
from odb_core.torch.collate import pack_collate as pack_collate
from odb_core.torch.collate import pad_collate as pad_collate
from odb_core.torch.collate import use_packed_attention as use_packed_attention
from odb_core.torch.loader import ODBDataLoader as ODBDataLoader
from odb_core.torch.lr_scheduler import ProgressLR as ProgressLR
from odb_core.torch.meta import STEP_META_KEY as STEP_META_KEY
from odb_core.torch.meta import StepMeta as StepMeta
from odb_core.torch.meta import causal_lm_loss as causal_lm_loss
from odb_core.torch.meta import pop_step_meta as pop_step_meta
from odb_core.torch.meta import read_step_meta as read_step_meta
from odb_core.torch.meta import scaled_loss as scaled_loss
from odb_core.torch.profile import sample_profile as sample_profile
from odb_core.torch.source import SampleLoadError as SampleLoadError
from odb_core.torch.state import merge_states as merge_states
from odb_core.torch.vlm import MRopeIndex as MRopeIndex
from odb_core.torch.vlm import VLMPackCollate as VLMPackCollate
from odb_core.torch.vlm import vlm_pack_collate as vlm_pack_collate
from odb_core.torch.vlm import vlm_pad_collate as vlm_pad_collate

__all__ = list(api.TORCH)


def __getattr__(name: str) -> Any:
    if name in api.DEPRECATED_TORCH:  # scale_loss: warns when called
        return getattr(importlib.import_module(api.DEPRECATED_TORCH[name]), name)
    raise AttributeError(f"module 'odb_core.torch' has no attribute {name!r}")
