"""A tiny Qwen3-VL (transformers' own classes, random init, no download) and
synthetic preprocessed samples for it: integer token ids with the model's image
token expanded to each image's visual tokens, pixel patches shaped as the Qwen-VL
image processor emits them (`grid_t*grid_h*grid_w` rows of `3*2*16*16`)."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
IMAGE_TOKEN = 60
VIDEO_TOKEN = 61
VISION_START = 62
VISION_END = 63
PATCH = 16
MERGE = 2
PATCH_DIM = 3 * 2 * PATCH * PATCH  # channels x temporal_patch_size x patch x patch


def tiny_qwen3_vl_config(**overrides: Any) -> Any:
    from transformers import Qwen3VLConfig

    text = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 4,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "out_hidden_size": 32,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        **overrides,
    )


def tiny_qwen3_vl(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: Any) -> Any:
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(**overrides))
    return model.to(dtype)


def vlm_sample(
    seed: int, images: list[tuple[int, int]], text: int = 6, answer: int = 5
) -> dict[str, Any]:
    """A preprocessed sample: `text` prompt tokens, then each image (grid h x w in
    patches, both even) as vision_start, its visual tokens, vision_end, then an
    `answer`; the prompt is label-masked."""
    g = torch.Generator().manual_seed(seed)

    def words(n: int) -> list[int]:
        return torch.randint(1, IMAGE_TOKEN - 1, (n,), generator=g).tolist()

    ids = words(text)
    pixels, grids = [], []
    for h, w in images:
        ids += [VISION_START] + [IMAGE_TOKEN] * (h * w // MERGE**2) + [VISION_END]
        pixels.append(torch.randn(h * w, PATCH_DIM, generator=g, dtype=torch.float64))
        grids.append([1, h, w])
    prompt = len(ids)
    ids += words(answer)
    input_ids = torch.tensor(ids)
    labels = input_ids.clone()
    labels[:prompt] = -100
    sample: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
    if images:
        sample["pixel_values"] = torch.cat(pixels)
        sample["image_grid_thw"] = torch.tensor(grids)
    return sample


#: The language model's attention projections (the bench's `--lora` targets).
LORA_TARGETS = r"model\.language_model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj"


def with_lora(model: Any, seed: int = 0) -> Any:
    """`model` (a tiny Qwen3-VL) under PEFT LoRA (rank 4 on the language model's
    q/k/v/o): only the adapter weights train; the vision tower and merger stay
    frozen. Both adapter matrices random (`init_lora_weights=False`: PEFT's zero B
    would give A a zero gradient, a weaker check)."""
    from peft import LoraConfig, get_peft_model

    dtype = next(model.parameters()).dtype
    torch.manual_seed(seed + 1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    return get_peft_model(model, config).to(dtype)


def image_mix(n: int, seed: int) -> list[list[tuple[int, int]]]:
    """`n` samples' images (grids in patches, both sides even): a quarter text-only,
    the rest one or two images of 1 to 8 visual tokens each."""
    import random

    rng = random.Random(seed)
    grids = [(2, 2), (2, 4), (4, 2), (4, 4), (4, 6), (6, 4), (8, 4)]
    return [[rng.choice(grids) for _ in range(rng.choice((0, 1, 1, 2)))] for _ in range(n)]


class VLMSet(torch.utils.data.Dataset):  # type: ignore[misc]
    """`vlm_sample`s with the given images (grid h x w per image; [] text-only);
    `text_extra` more prompt tokens on text-only samples, and every
    `masked_every`-th sample without an answer (every label masked)."""

    def __init__(
        self, images: list[list[tuple[int, int]]], text_extra: int = 0, masked_every: int = 0
    ) -> None:
        self.images = images
        self.text_extra = text_extra
        self.masked_every = masked_every

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, Any]:
        extra = 0 if self.images[i] else self.text_extra
        masked = self.masked_every and i % self.masked_every == self.masked_every - 1
        answer = 0 if masked else 3 + (7 * i) % 6
        return vlm_sample(i, self.images[i], text=4 + i % 5 + extra, answer=answer)


def one_sample_batch(sample: dict[str, Any]) -> dict[str, Any]:
    """One sample as a batch of one, positioned by the model itself (no
    position_ids: it runs its own get_rope_index)."""
    from odb_core.torch.vlm import vlm_pad_collate

    return vlm_pad_collate([sample], image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN)
