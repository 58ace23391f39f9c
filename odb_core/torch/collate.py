"""Collators for `cost_model="padded"` and `cost_model="packed"` batches, and a
varlen attention for packed rows of HF causal LMs.

    pad_collate(samples)   # [n, max_len] rows, right-padded; labels -100 on padding
    pack_collate(samples)  # one [1, sum(len)] row; position_ids restart at 0 per sample;
                           # each sample's first label masked (no prediction across a
                           # boundary); "use_cache": False (see below)

A sample is a mapping with a 1-D `input_ids` tensor and optionally `labels`
(default: a copy of `input_ids`), as the loader's loss-token count reads it.
`pack_collate` refuses a sample with images (`VISUAL_KEYS`): under multimodal RoPE
its image tokens need 3-D positions, which `odb_core.torch.vlm` gives.

Attention inside each sample. A packed row has no attention mask; transformers
5.24 then builds a per-sample (block-diagonal) mask from `position_ids`, but only
when no KV cache is built: with `use_cache=True` (the default of most configs,
also in training) attention silently crosses samples. So `pack_collate` puts
`use_cache=False` into the batch (`model(**batch)` passes it on), and
`check_packed_model(model)` raises if a model would build that dense mask with a
cache anyway. The dense mask is `sum(len)^2` per head, slow on CPU for long rows:
`use_packed_attention(model)` switches the model to `"odb_varlen"`, which runs
SDPA on each sample's own segment (found from `position_ids`), builds no mask,
and is correct with or without a cache. It keeps plain SDPA for a batch that has
an attention mask (padded rows), so one model serves both collators.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from odb_core.errors import ConfigError
from odb_core.torch.measure import VISUAL_KEYS

__all__ = [
    "IGNORE_INDEX",
    "VARLEN_ATTENTION",
    "VISUAL_KEYS",
    "check_packed_model",
    "pack_collate",
    "packed_segments",
    "pad_collate",
    "register_packed_attention",
    "use_packed_attention",
]

IGNORE_INDEX = -100
VARLEN_ATTENTION = "odb_varlen"


def _ids_and_labels(
    samples: Sequence[Mapping[str, Any]], where: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if not isinstance(samples, Sequence) or isinstance(samples, Mapping) or not samples:
        raise ValueError(f"{where}: expected a non-empty list of samples, got {samples!r:.80}")
    ids_out: list[torch.Tensor] = []
    labels_out: list[torch.Tensor] = []
    for k, s in enumerate(samples):
        if not isinstance(s, Mapping) or "input_ids" not in s:
            raise ValueError(f"{where}: sample {k} is not a mapping with 'input_ids'")
        ids = torch.as_tensor(s["input_ids"])
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point:
            raise ValueError(
                f"{where}: sample {k} has input_ids of shape {tuple(ids.shape)} and dtype "
                f"{ids.dtype}; expected a non-empty 1-D integer tensor"
            )
        labels = torch.as_tensor(s["labels"]) if "labels" in s else ids
        if labels.shape != ids.shape:
            raise ValueError(
                f"{where}: sample {k} has labels of shape {tuple(labels.shape)} but input_ids "
                f"of shape {tuple(ids.shape)}"
            )
        ids_out.append(ids)
        labels_out.append(labels)
    return ids_out, labels_out


def pad_collate(
    samples: Sequence[Mapping[str, Any]],
    *,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: `input_ids` (padded with `pad_token_id`),
    `labels` (-100 on padding) and `attention_mask` (1 on real tokens)."""
    ids, labels = _ids_and_labels(samples, "pad_collate")
    n, longest = len(ids), max(len(x) for x in ids)
    out_ids = torch.full((n, longest), pad_token_id, dtype=ids[0].dtype)
    out_labels = torch.full((n, longest), ignore_index, dtype=labels[0].dtype)
    mask = torch.zeros((n, longest), dtype=torch.long)
    for row, (x, y) in enumerate(zip(ids, labels, strict=True)):
        out_ids[row, : len(x)] = x
        out_labels[row, : len(y)] = y
        mask[row, : len(x)] = 1
    return {"input_ids": out_ids, "labels": out_labels, "attention_mask": mask}


def pack_collate(
    samples: Sequence[Mapping[str, Any]],
    *,
    ignore_index: int = IGNORE_INDEX,
    use_cache_key: bool = True,
) -> dict[str, Any]:
    """One row `[1, sum(len)]`: the samples end to end, `position_ids` restarting
    at 0 for each, and each sample's first label set to `ignore_index`, so with a
    one-token label shift no token predicts the next sample's first token (the
    loader's loss-token count, `labels[1:] != -100`, already leaves it out). With
    `use_cache_key` the batch carries `use_cache=False` for `model(**batch)`."""
    ids, labels = _ids_and_labels(samples, "pack_collate")
    for k, s in enumerate(samples):
        visual = [key for key in VISUAL_KEYS if s.get(key) is not None]
        if visual:
            raise ValueError(
                f"pack_collate: sample {k} has {', '.join(visual)}: its image tokens need "
                "multimodal positions, which 1-D positions restarting at 0 get wrong; use "
                "odb_core.torch.vlm.VLMPackCollate(MRopeIndex.from_model(model))"
            )
    packed_labels = torch.cat(labels).clone()
    start = 0
    for x in ids:
        packed_labels[start] = ignore_index
        start += len(x)
    out: dict[str, Any] = {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat([torch.arange(len(x)) for x in ids])[None],
        "labels": packed_labels[None],
    }
    if use_cache_key:
        out["use_cache"] = False
    return out


def packed_segments(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the `(start, end)` of each sample: a sample starts where the
    position does not continue the previous one (`pos[t] != pos[t-1] + 1`)."""
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    rows: list[list[tuple[int, int]]] = []
    for row in position_ids:
        n = int(row.numel())
        if n == 0:
            rows.append([])
            continue
        breaks = torch.nonzero(row[1:] != row[:-1] + 1).reshape(-1).add(1).tolist()
        bounds = [0, *breaks, n]
        rows.append([(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)])
    return rows


_PAD_SLACK = 1.25  # a group of segments may compute up to 25% padded attention rows


class _Plan:
    """How one batch's segments are grouped for attention: segments sorted longest
    first, grouped while the group's padded size (count x longest) stays within
    `_PAD_SLACK` x its real tokens; each group is one SDPA call on right-padded rows
    (causal, so no real query sees a pad key: no mask is needed)."""

    def __init__(self, position_ids: torch.Tensor, rows: int, length: int) -> None:
        segs = [
            (b * length + s, e - s)
            for b, row in enumerate(packed_segments(position_ids.expand(rows, -1)))
            for s, e in row
        ]
        segs.sort(key=lambda x: -x[1])
        groups: list[list[tuple[int, int]]] = []
        cur: list[tuple[int, int]] = []
        real = 0
        for start, n in segs:
            if cur and (len(cur) + 1) * cur[0][1] > _PAD_SLACK * (real + n):
                groups.append(cur)
                cur, real = [], 0
            cur.append((start, n))
            real += n
        if cur:
            groups.append(cur)
        device = position_ids.device
        self.groups: list[tuple[torch.Tensor, int, int]] = []
        self.inverse = torch.empty(rows * length, dtype=torch.long, device=device)
        offset = 0
        for grp in groups:
            g, m = len(grp), grp[0][1]
            starts = torch.tensor([st for st, _ in grp], device=device)
            lens = torch.tensor([n for _, n in grp], device=device)
            ar = torch.arange(m, device=device)
            idx = torch.minimum(starts[:, None] + ar, (starts + lens - 1)[:, None])
            valid = ar[None, :] < lens[:, None]
            dest = torch.arange(offset, offset + g * m, device=device).view(g, m)
            self.inverse[idx[valid]] = dest[valid]
            self.groups.append((idx.reshape(-1), g, m))
            offset += g * m


_plan_cache: list[Any] = [None, 0, 0, None]  # position_ids (held), rows, length, plan


def _plan_for(position_ids: torch.Tensor, rows: int, length: int) -> _Plan:
    # One plan per forward: every layer gets the same position_ids object, and
    # holding it keeps its memory from being reused by another batch's.
    c = _plan_cache
    if c[0] is not position_ids or c[1] != rows or c[2] != length:
        c[:] = [position_ids, rows, length, _Plan(position_ids, rows, length)]
    plan: _Plan = c[3]
    return plan


def _varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention inside each sample segment of each row, nothing across.
    query [B, H, L, D], key/value [B, Hkv, L, D] -> [B, L, H, D]. Segments of
    similar length share one SDPA call (see `_Plan`); with an attention mask
    (padded rows) or a KV cache longer than the query, plain SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    same_len = query.shape[2] == key.shape[2]
    if attention_mask is not None or position_ids is None or not same_len:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    plan = _plan_for(position_ids, rows, length)
    qf = query.transpose(0, 1).reshape(heads, rows * length, dim)
    kf = key.transpose(0, 1).reshape(kv_heads, rows * length, dim)
    vf = value.transpose(0, 1).reshape(kv_heads, rows * length, dim)
    outs = []
    for idx, g, m in plan.groups:
        q = qf.index_select(1, idx).view(heads, g, m, dim).transpose(0, 1)
        k = kf.index_select(1, idx).view(kv_heads, g, m, dim).transpose(0, 1)
        v = vf.index_select(1, idx).view(kv_heads, g, m, dim).transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=dropout if module.training else 0.0,
            is_causal=m > 1,
            scale=scaling,
            enable_gqa=heads != kv_heads,
        )
        outs.append(o.transpose(0, 1).reshape(heads, g * m, dim))
    flat = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)).index_select(1, plan.inverse)
    return flat.view(heads, rows, length, dim).permute(1, 2, 0, 3).contiguous(), None


def _varlen_mask(*args: Any, **kwargs: Any) -> Any:
    """The mask for "odb_varlen": SDPA's own when the batch has an attention mask
    (padded rows), none otherwise (the attention function splits the segments)."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def register_packed_attention() -> str:
    """Register `"odb_varlen"` with transformers' attention and mask interfaces;
    returns the name (for `attn_implementation=` or `set_attn_implementation`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, _varlen_attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)
    return VARLEN_ATTENTION


def use_packed_attention(model: Any) -> Any:
    """Switch an HF model (or a DDP/FSDP wrapper's `.module`) to `"odb_varlen"`
    attention; returns the model."""
    inner = getattr(model, "module", model)
    if not hasattr(inner, "set_attn_implementation"):
        raise ConfigError(
            f"{type(inner).__name__} has no set_attn_implementation: not a transformers model"
        )
    inner.set_attn_implementation(register_packed_attention())
    return model


def _configs(config: Any, depth: int = 0) -> list[Any]:
    """`config` and every config nested in it (a multimodal model's `text_config`,
    `vision_config`, ...), found by shape: an attribute with `model_type` and
    `to_dict`."""
    found = [config]
    if depth < 4:
        for value in vars(config).values() if hasattr(config, "__dict__") else ():
            if hasattr(value, "model_type") and hasattr(value, "to_dict"):
                found += _configs(value, depth + 1)
    return found


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def check_packed_model(model: Any, batch: Mapping[str, Any] | None = None) -> None:
    """Raise `ConfigError` if packed rows would attend across samples: a model whose
    (text) attention is not `"odb_varlen"` builds its per-sample mask from
    `position_ids` only without a KV cache, so `use_cache` must be False (in the
    batch, or, when the batch does not say, in the config and every config nested
    in it: a multimodal model such as Qwen3-VL keeps `use_cache` in `text_config`)."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    if config is None:
        raise ConfigError(f"{type(inner).__name__} has no .config: not a transformers model")
    impl = getattr(_text_config(config), "_attn_implementation", None)
    if impl == VARLEN_ATTENTION:
        return
    use_cache = batch.get("use_cache") if batch is not None else None
    where = "the batch"
    if use_cache is None:
        caching = [c for c in _configs(config) if getattr(c, "use_cache", False)]
        use_cache = bool(caching)
        where = f"{type(caching[0]).__name__}" if caching else "the config"
    if use_cache:
        raise ConfigError(
            f"packed rows with attn_implementation={impl!r} and use_cache=True (from {where}) "
            "attend across samples (transformers builds the per-sample mask from position_ids "
            "only without a cache): pass use_cache=False (pack_collate does), set use_cache="
            "False in the (text) config, or call odb_core.torch.use_packed_attention(model)"
        )
