"""Collators for vision-language models with multimodal RoPE (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL): a sample's image tokens get 3-D (temporal, height, width) positions,
so a packed row cannot restart plain 1-D positions at each sample as
`pack_collate` does for text.

    rope = MRopeIndex.from_model(model)      # picklable; holds the config, not the model
    collate = VLMPackCollate(rope)            # DataLoader / ODBDataLoader collate_fn
    vlm_pack_collate(samples, rope)           # the same, as a function
    vlm_pad_collate(samples, image_token_id=..., video_token_id=...)  # padded rows

A sample is a mapping with a 1-D `input_ids` already holding the expanded image
tokens (as the Qwen-VL processor returns it), optional `labels`, and for each
image its `pixel_values` rows and one `image_grid_thw` row (videos:
`pixel_values_videos`, `video_grid_thw`). It may carry its own `position_ids`
of shape [3, len] (e.g. `rope(...)` run in preprocessing); otherwise the
collate runs `rope` on it.

A packed batch is one row: `input_ids`/`labels` [1, N] as `pack_collate` builds
them, and `position_ids` [4, 1, N]: row 0 the text positions restarting at 0 per
sample (transformers' Qwen-VL text model reads row 0 to find the samples, for
its packed mask, for `use_packed_attention`'s segments and for the
flash-attention varlen `cu_seqlens`), rows 1-3 each sample's own 3-D positions
from the model's own `get_rope_index`. `pixel_values`/`image_grid_thw` are
concatenated in sample order (the vision tower attends within each image).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from odb_core.errors import ConfigError
from odb_core.torch.collate import IGNORE_INDEX, pack_collate, pad_collate

__all__ = ["MRopeIndex", "VLMPackCollate", "vlm_pack_collate", "vlm_pad_collate"]

_GRIDS = (("image_grid_thw", "pixel_values", 1), ("video_grid_thw", "pixel_values_videos", 2))


class _RopeHost:
    """Stands in for the model instance when its class's `get_rope_index` runs:
    methods bind to this object, `config` is the model's config."""

    def __init__(self, cls: type, config: Any) -> None:
        self._cls = cls
        self.config = config

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._cls, name)
        return attr.__get__(self) if callable(attr) else attr


class MRopeIndex:
    """One sample's multimodal positions [3, len], by the model class's own
    `get_rope_index` run on the model's config. Picklable (class and config
    only), so it runs in DataLoader workers without the model."""

    def __init__(self, model_cls: type, config: Any) -> None:
        if not callable(getattr(model_cls, "get_rope_index", None)):
            raise ConfigError(
                f"{model_cls.__name__} has no get_rope_index: not a multimodal-RoPE model"
            )
        self.model_cls = model_cls
        self.config = config
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(getattr(config, "video_token_id", -1) or -1)
        self.spatial_merge_size = int(config.vision_config.spatial_merge_size)

    @classmethod
    def from_model(cls, model: Any) -> MRopeIndex:
        """From a model (or its DDP/FSDP/PEFT wrapper) whose class, or whose
        `.model`, has `get_rope_index` (e.g. `Qwen3VLForConditionalGeneration`)."""
        inner = getattr(model, "module", model)
        for _ in range(4):  # PEFT wraps twice (base_model.model); the VLM keeps it on .model
            if callable(getattr(type(inner), "get_rope_index", None)):
                return cls(type(inner), inner.config)
            inner = getattr(inner, "model", None)
            if inner is None:
                break
        raise ConfigError(
            f"{type(getattr(model, 'module', model)).__name__} has no get_rope_index: "
            "not a multimodal-RoPE model (use pack_collate)"
        )

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """mm_token_type_ids: 1 on image tokens, 2 on video tokens, 0 elsewhere."""
        types = torch.zeros_like(input_ids, dtype=torch.int32)
        types[input_ids == self.image_token_id] = 1
        types[input_ids == self.video_token_id] = 2
        return types

    def __call__(
        self,
        input_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        *,
        where: str = "sample",
    ) -> torch.Tensor:
        ids = torch.as_tensor(input_ids)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"{where}: input_ids of shape {tuple(ids.shape)}; expected 1-D")
        types = self.token_types(ids)
        grids = {"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw}
        for key, _, kind in _GRIDS:
            grid = grids[key]
            tokens = int((types == kind).sum())
            visual = 0 if grid is None else int(grid.prod(-1).sum()) // self.spatial_merge_size**2
            if tokens != visual:
                raise ValueError(
                    f"{where} cannot be positioned: {tokens} {key[:5]} tokens in input_ids but "
                    f"{key}={None if grid is None else grid.tolist()} gives {visual} visual "
                    "tokens (input_ids must hold the processor's expanded tokens, every image "
                    "its grid row)"
                )
        host = _RopeHost(self.model_cls, self.config)
        position_ids, _ = self.model_cls.get_rope_index(  # type: ignore[attr-defined]
            host,
            ids[None],
            mm_token_type_ids=types[None],
            image_grid_thw=None if image_grid_thw is None else image_grid_thw.clone(),
            video_grid_thw=None if video_grid_thw is None else video_grid_thw.clone(),
        )
        out: torch.Tensor = position_ids[:, 0]
        return out


def _visuals(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for grid_key, pixel_key, _ in _GRIDS:
        grids = [torch.as_tensor(s[grid_key]) for s in samples if s.get(grid_key) is not None]
        pixels = [torch.as_tensor(s[pixel_key]) for s in samples if s.get(pixel_key) is not None]
        if grids:
            out[grid_key] = torch.cat(grids)
        if pixels:
            out[pixel_key] = torch.cat(pixels)
    return out


def _text_part(samples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k in ("input_ids", "labels")} for s in samples]


def _check_pairs(samples: Sequence[Mapping[str, Any]], where: str) -> None:
    for k, s in enumerate(samples):
        for grid_key, pixel_key, _ in _GRIDS:
            if (s.get(grid_key) is None) != (s.get(pixel_key) is None):
                raise ValueError(
                    f"{where}: sample {k} has {pixel_key} without {grid_key} or the reverse"
                )


def vlm_pack_collate(
    samples: Sequence[Mapping[str, Any]],
    rope: MRopeIndex | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    use_cache_key: bool = True,
) -> dict[str, Any]:
    """One packed row with per-sample multimodal positions (see the module
    docstring). `rope=None`: every sample must carry `position_ids` [3, len]."""
    if isinstance(samples, Sequence) and not isinstance(samples, Mapping):
        _check_pairs(samples, "vlm_pack_collate")
    out = pack_collate(_text_part(samples), ignore_index=ignore_index, use_cache_key=use_cache_key)
    mrope = []
    for k, s in enumerate(samples):
        ids = torch.as_tensor(s["input_ids"])
        own = s.get("position_ids")
        if own is not None:
            pos = torch.as_tensor(own)
            if pos.shape != (3, len(ids)):
                raise ValueError(
                    f"vlm_pack_collate: sample {k} has position_ids of shape {tuple(pos.shape)}; "
                    f"expected (3, {len(ids)}) (its multimodal positions)"
                )
        elif rope is None:
            raise ValueError(
                f"vlm_pack_collate: sample {k} cannot be positioned: it has no position_ids "
                "and no rope was given (pass rope=MRopeIndex.from_model(model))"
            )
        else:
            pos = rope(ids, s.get("image_grid_thw"), s.get("video_grid_thw"), where=f"sample {k}")
        mrope.append(pos)
    text = out["position_ids"]
    out["position_ids"] = torch.cat([text[None], torch.cat(mrope, dim=1)[:, None]], dim=0)
    out.update(_visuals(samples))
    return out


class VLMPackCollate:
    """`vlm_pack_collate` as a picklable collate_fn: `VLMPackCollate(rope)`."""

    def __init__(
        self,
        rope: MRopeIndex | None,
        *,
        ignore_index: int = IGNORE_INDEX,
        use_cache_key: bool = True,
    ) -> None:
        self.rope = rope
        self.ignore_index = ignore_index
        self.use_cache_key = use_cache_key

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return vlm_pack_collate(
            samples, self.rope, ignore_index=self.ignore_index, use_cache_key=self.use_cache_key
        )


def vlm_pad_collate(
    samples: Sequence[Mapping[str, Any]],
    *,
    image_token_id: int,
    video_token_id: int = -1,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, Any]:
    """`pad_collate` rows plus the visual fields concatenated in sample order and
    `mm_token_type_ids` (the model computes its 3-D positions from them and the
    attention mask)."""
    if isinstance(samples, Sequence) and not isinstance(samples, Mapping):
        _check_pairs(samples, "vlm_pad_collate")
    out: dict[str, Any] = pad_collate(
        _text_part(samples), pad_token_id=pad_token_id, ignore_index=ignore_index
    )
    ids = out["input_ids"]
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[(ids == image_token_id) & (out["attention_mask"] == 1)] = 1
    types[(ids == video_token_id) & (out["attention_mask"] == 1)] = 2
    out["mm_token_type_ids"] = types
    out.update(_visuals(samples))
    return out
