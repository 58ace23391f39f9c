"""The VLM workload of `odb bench --model qwen3-vl-tiny`: transformers' own
`Qwen3VLForConditionalGeneration` built from a small config (vision tower and
language model, no download), the batch collator (padded rows, or packed rows
with each sample's own multimodal positions), `--lora`'s PEFT adapters, and the
hooks a rank of `odb_core.bench.model_bench` runs it through (`VLMWorkload`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from odb_core.bench.vlm_data import MixParams
from odb_core.bench.vlm_preprocess import MERGE, PATCH, TEMPORAL, VLMSFT, VOCAB, token_id

if TYPE_CHECKING:
    from odb_core.torch.vlm import MRopeIndex

# name: (vision depth, vision hidden, text layers, text hidden, text intermediate)
VLM_SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "qwen3-vl-tiny": (2, 64, 2, 128, 256),
}


def vlm_config(size: str) -> Any:
    from transformers import Qwen3VLConfig

    depth, v_hidden, layers, hidden, inter = VLM_SIZES[size]
    heads, head_dim = 4, hidden // 4
    half = head_dim // 2  # mRoPE sections (t, h, w) over head_dim / 2 frequencies
    config = Qwen3VLConfig(
        vision_config={
            "depth": depth,
            "hidden_size": v_hidden,
            "intermediate_size": 2 * v_hidden,
            "num_heads": 4,
            "out_hidden_size": hidden,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL,
            "num_position_embeddings": 1024,
            "deepstack_visual_indexes": [0],
        },
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": 2,
            "head_dim": head_dim,
            "max_position_embeddings": 4096,
            "use_cache": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16],
                "mrope_interleaved": True,
            },
        },
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    return config


def build_vlm(size: str, seed: int) -> Any:
    """The model on `"odb_varlen"` attention: plain SDPA for padded rows (they carry
    an attention mask) and inside the vision tower (it splits by image itself),
    SDPA per sample segment for packed rows (found from their text positions)."""
    from transformers import Qwen3VLForConditionalGeneration

    from odb_core.torch.collate import use_packed_attention

    torch.manual_seed(seed)
    return use_packed_attention(Qwen3VLForConditionalGeneration(vlm_config(size)))


# PEFT LoRA (`--lora`): adapters on the language model's attention projections only;
# the vision tower, merger, embeddings, MLPs and norms stay frozen.
LORA_TARGETS = r"model\.language_model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj"
LORA_RANK = 8


def with_lora(model: Any) -> Any:
    """`model` under PEFT LoRA (rank 8, alpha 16, on `LORA_TARGETS`): only the
    `lora_` weights train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=LORA_TARGETS
    )
    return get_peft_model(model, config)


def rope_index(size: str) -> MRopeIndex:
    """The model class's own multimodal position function on the bench's config
    (picklable; no model built)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    from odb_core.torch.vlm import MRopeIndex

    return MRopeIndex(Qwen3VLModel, vlm_config(size))


class VLMCollate:
    """Padded rows (the library's `pad_collate`, pad id `<|endoftext|>`) plus the
    batch's images: `pixel_values` concatenated in row order, `image_grid_thw` one
    row per image, `mm_token_type_ids` (the model's multimodal RoPE reads it); and
    the bench's ids and collate time. With `rope` (`rope_index`), one packed row
    instead (`VLMPackCollate`: each sample's own 3-D positions from the model's
    `get_rope_index`, `use_cache=False`)."""

    def __init__(self, rope: MRopeIndex | None = None) -> None:
        from odb_core.torch.vlm import VLMPackCollate

        self.pack = None if rope is None else VLMPackCollate(rope)

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        from odb_core.torch.collate import pad_collate

        start = time.perf_counter()
        if self.pack is not None:
            packed = self.pack(samples)
            return self._bench_fields(packed, samples, start)
        core = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples]
        out: dict[str, Any] = pad_collate(core, pad_token_id=token_id("<|endoftext|>"))
        with_images = [s for s in samples if "pixel_values" in s]
        if with_images:
            out["pixel_values"] = torch.cat([s["pixel_values"] for s in with_images])
            out["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in with_images])
            # what Qwen3VLProcessor returns beside input_ids: 1 on image tokens
            out["mm_token_type_ids"] = (out["input_ids"] == token_id("<|image_pad|>")).long()
        return self._bench_fields(out, samples, start)

    @staticmethod
    def _bench_fields(
        out: dict[str, Any], samples: Sequence[dict[str, Any]], start: float
    ) -> dict[str, Any]:
        out["bench_ids"] = torch.tensor([int(s["idx"]) for s in samples], dtype=torch.long)
        out["bench_collate_s"] = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        return out


class VLMWorkload:
    """What a bench rank (`model_setup.RankSetup`) needs of a workload, for the VLM mix."""

    text_only = False
    # a step whose batch holds no image leaves the vision tower without gradients
    find_unused_parameters = True

    def __init__(self, size: str, max_len: int, lora: bool = False) -> None:
        self.size = size
        self.max_len = max_len
        self.lora = lora

    def dataset(self, n: int, seed: int) -> VLMSFT:
        return VLMSFT(n, self.max_len, seed)

    def pretrain_dataset(self, n: int, seed: int) -> VLMSFT:
        """The fine-tuning regime's other distribution: the same kinds of images,
        questions and colour words, the answers under another rule."""
        return VLMSFT(n, self.max_len, seed, MixParams(answer_rule=3))

    def pretrain_collate(self) -> VLMCollate:
        return VLMCollate()

    def model(self, seed: int) -> Any:
        model = build_vlm(self.size, seed)
        return with_lora(model) if self.lora else model

    def collate(self, packed: bool) -> VLMCollate:
        return VLMCollate(rope_index(self.size) if packed else None)

    def vision_tower(self, model: Any) -> Any:
        base = model.get_base_model() if self.lora else model
        return base.model.visual

    def eval_batch(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """A held-out chunk as one padded batch (labels included)."""
        out = VLMCollate()(samples)
        out.pop("bench_ids")
        out.pop("bench_collate_s")
        return out
