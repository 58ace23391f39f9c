"""odb-core: online dynamic batching with a verified distributed alignment protocol.

`import odb_core` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from odb_core.batch import Batch as Batch
from odb_core.collective import Contribution as Contribution
from odb_core.collective import RoundDecision as RoundDecision
from odb_core.collective import decide_round as decide_round
from odb_core.config import LossNormalization as LossNormalization
from odb_core.config import Mode as Mode
from odb_core.config import OversizePolicy as OversizePolicy
from odb_core.config import ProtocolConfig as ProtocolConfig
from odb_core.cost import AttentionAware as AttentionAware
from odb_core.cost import BatchStats as BatchStats
from odb_core.cost import Budget as Budget
from odb_core.cost import Multimodal as Multimodal
from odb_core.cost import PackedTokens as PackedTokens
from odb_core.cost import PaddedTokens as PaddedTokens
from odb_core.errors import ConfigError as ConfigError
from odb_core.errors import DuplicateIdError as DuplicateIdError
from odb_core.errors import DuplicateSampleError as DuplicateSampleError
from odb_core.errors import ODBError as ODBError
from odb_core.errors import ODBPeerError as ODBPeerError
from odb_core.errors import OversizeSampleError as OversizeSampleError
from odb_core.errors import PeerFault as PeerFault
from odb_core.errors import ProtocolError as ProtocolError
from odb_core.errors import ResumeMismatchError as ResumeMismatchError
from odb_core.errors import ResumeStateError as ResumeStateError
from odb_core.errors import SampleError as SampleError
from odb_core.formers import FormerKind as FormerKind
from odb_core.formers import best_fit_decreasing as best_fit_decreasing
from odb_core.formers import sort_window_greedy as sort_window_greedy
from odb_core.protocol import RankMachine as RankMachine
from odb_core.protocol import RankPhase as RankPhase
from odb_core.sample import Sample as Sample
from odb_core.sample import make_sample as make_sample
from odb_core.step import StepInfo as StepInfo

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
    from odb_core.torch import read_step_meta as read_step_meta
    from odb_core.torch import sample_profile as sample_profile
    from odb_core.torch import scaled_loss as scaled_loss
    from odb_core.torch import use_packed_attention as use_packed_attention
    from odb_core.torch import vlm_pack_collate as vlm_pack_collate
    from odb_core.torch import vlm_pad_collate as vlm_pad_collate

__version__ = "0.1.0"

from odb_core import api

# torch-backed names (api.TORCH), imported on first use so that `import odb_core` never
# imports torch; tests/test_imports.py holds the block above equal to api.TORCH.


def __getattr__(name: str) -> Any:
    if name in api.TORCH:
        value = getattr(importlib.import_module("odb_core.torch"), name)
        globals()[name] = value
        return value
    if name in api.DEPRECATED_TORCH:
        return getattr(importlib.import_module(api.DEPRECATED_TORCH[name]), name)
    raise AttributeError(f"module 'odb_core' has no attribute {name!r}")


__all__ = ["__version__", *api.CORE, *api.TORCH]
