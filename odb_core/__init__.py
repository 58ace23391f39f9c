"""odb-core: online dynamic batching with a verified distributed alignment protocol.

`import odb_core` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from odb_core.batch import Batch
from odb_core.config import LossNormalization, Mode, OversizePolicy, ProtocolConfig
from odb_core.cost import AttentionAware, BatchStats, Budget, Multimodal, PackedTokens, PaddedTokens
from odb_core.errors import (
    ConfigError,
    DuplicateIdError,
    DuplicateSampleError,
    ODBError,
    ODBPeerError,
    OversizeSampleError,
    PeerFault,
    ProtocolError,
    ResumeMismatchError,
    ResumeStateError,
    SampleError,
)
from odb_core.formers import FormerKind, best_fit_decreasing, sort_window_greedy
from odb_core.protocol import (
    Contribution,
    RankMachine,
    RankPhase,
    RoundDecision,
    StepInfo,
    decide_round,
)
from odb_core.sample import Sample, make_sample

if TYPE_CHECKING:
    from odb_core.torch import STEP_META_KEY as STEP_META_KEY
    from odb_core.torch import MRopeIndex as MRopeIndex
    from odb_core.torch import ODBDataLoader as ODBDataLoader
    from odb_core.torch import ProgressLR as ProgressLR
    from odb_core.torch import SampleLoadError as SampleLoadError
    from odb_core.torch import StepMeta as StepMeta
    from odb_core.torch import VLMPackCollate as VLMPackCollate
    from odb_core.torch import causal_lm_loss as causal_lm_loss
    from odb_core.torch import check_packed_model as check_packed_model
    from odb_core.torch import merge_states as merge_states
    from odb_core.torch import pack_collate as pack_collate
    from odb_core.torch import pad_collate as pad_collate
    from odb_core.torch import pop_step_meta as pop_step_meta
    from odb_core.torch import sample_profile as sample_profile
    from odb_core.torch import scale_loss as scale_loss
    from odb_core.torch import scaled_loss as scaled_loss
    from odb_core.torch import step_meta as step_meta
    from odb_core.torch import use_packed_attention as use_packed_attention
    from odb_core.torch import vlm_pack_collate as vlm_pack_collate
    from odb_core.torch import vlm_pad_collate as vlm_pad_collate

__version__ = "0.1.0"

# torch-backed names, imported on first use so that `import odb_core` never imports torch;
# tests/test_imports.py holds this list, the block above and odb_core.torch.__all__ equal.
_TORCH_EXPORTS = (
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
)


def __getattr__(name: str) -> Any:
    if name in _TORCH_EXPORTS:
        value = getattr(importlib.import_module("odb_core.torch"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'odb_core' has no attribute {name!r}")


__all__ = [
    "AttentionAware",
    "Batch",
    "BatchStats",
    "Budget",
    "ConfigError",
    "Contribution",
    "DuplicateIdError",
    "DuplicateSampleError",
    "FormerKind",
    "LossNormalization",
    "Mode",
    "Multimodal",
    "ODBError",
    "ODBPeerError",
    "OversizePolicy",
    "OversizeSampleError",
    "PackedTokens",
    "PaddedTokens",
    "PeerFault",
    "ProtocolConfig",
    "ProtocolError",
    "RankMachine",
    "RankPhase",
    "ResumeMismatchError",
    "ResumeStateError",
    "RoundDecision",
    "Sample",
    "SampleError",
    "StepInfo",
    "__version__",
    "best_fit_decreasing",
    "decide_round",
    "make_sample",
    "sort_window_greedy",
]
