"""The public API of `odb_core`, listed once: what `odb_core.__all__` and
`odb_core.torch.__all__` are made of (tests/test_imports.py pins it). Deprecated
names still work, warn, and are listed in neither.

Torch-free: `import odb_core` reads it without importing torch.
"""

from __future__ import annotations

#: The pure core's names, importable without torch.
CORE = (
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
    "best_fit_decreasing",
    "decide_round",
    "make_sample",
    "sort_window_greedy",
)

#: The torch adapter's names (`odb_core.torch`), imported from `odb_core` on first use.
TORCH = (
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
    "scaled_loss",
    "read_step_meta",
    "use_packed_attention",
    "vlm_pack_collate",
    "vlm_pad_collate",
)

#: Deprecated names: where each still lives (it warns when used); exported nowhere.
DEPRECATED_TORCH = {"scale_loss": "odb_core.torch.loss", "step_meta": "odb_core.torch.meta"}
