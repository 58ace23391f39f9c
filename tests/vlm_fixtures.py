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
