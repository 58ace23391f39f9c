"""Preprocessing of `odb bench --model qwen3-vl-tiny`, the real parts a user runs:
transformers' Qwen2-VL PIL image processor with Qwen3-VL's settings (16 px patches,
2 x 2 merge, dynamic resolution between min/max_pixels: visual tokens =
patches / merge^2, so they follow each image's size), the Qwen-VL chat template,
and a byte-level BPE tokenizer the bench trains locally with `tokenizers`.

`Qwen3VLProcessor` itself cannot be built without torchvision (its constructor
checks a video processor class that imports it), so `VLMSFT.__getitem__` expands
each image's `<|image_pad|>` exactly as its `replace_image_token` does:
`image_grid_thw.prod() // merge_size**2` pads per image.
"""

from __future__ import annotations

import functools
import io
from typing import Any

import torch
from torch.utils.data import Dataset

from odb_core.bench.vlm_data import MixParams, RawSample, corpus, raw_sample

PATCH = 16
MERGE = 2
TEMPORAL = 2
MIN_PIXELS = 32 * 32
MAX_PIXELS = 512 * 512
VOCAB = 1024
SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen-VL's template (images first in the user turn, as Qwen's own template renders
# a content list), without the default system turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.cache
def tokenizer() -> Any:
    """A byte-level BPE (VOCAB entries) trained on the mix's word list, with the
    special tokens Qwen3-VL's template and image expansion use."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(0), trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@functools.cache
def image_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )


def token_id(token: str) -> int:
    return int(tokenizer().convert_tokens_to_ids(token))


def visual_tokens(grid_thw: torch.Tensor) -> list[int]:
    """Visual tokens per image of an `image_grid_thw` (t x h x w patches / merge^2)."""
    return [int(g.prod()) // MERGE**2 for g in grid_thw]


class SampleDecodeError(ValueError):
    """A stored image that does not decode; names the sample."""


class VLMSFT(Dataset[dict[str, Any]]):
    """The mix as a map-style SFT dataset: `__getitem__` decodes the sample's
    images, runs the image processor, renders the chat template with each image's
    pads expanded, tokenizes, masks the prompt's labels, and truncates the answer
    at `max_len` (a user's `model_max_length`). Its cost is known only then."""

    def __init__(self, n: int, max_len: int, seed: int, params: MixParams | None = None) -> None:
        self.params = params or MixParams()
        self.max_len = max_len
        self.seed = seed
        self.raw: list[RawSample] = [raw_sample(seed, i, self.params) for i in range(n)]

    def __len__(self) -> int:
        return len(self.raw)

    def modality_lengths(self) -> list[int]:
        """LLaVA's `modality_lengths`: words of text, positive with images and
        negative without; read from the stored text, no preprocessing pass."""
        return [r.words if r.images else -r.words for r in self.raw]

    def __getitem__(self, i: int) -> dict[str, Any]:
        from PIL import Image

        raw = self.raw[i]
        try:
            images = [Image.open(io.BytesIO(b)).convert("RGB") for b in raw.images]
        except Exception as exc:
            raise SampleDecodeError(
                f"sample {i}: an image does not decode ({type(exc).__name__}: {exc})"
            ) from exc
        tok = tokenizer()
        pad = "<|image_pad|>"
        user = {
            "role": "user",
            "content": [
                *({"type": "image"} for _ in images),
                {"type": "text", "text": raw.question},
            ],
        }
        prompt = tok.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        answer = raw.answer + "<|im_end|>\n"
        out: dict[str, Any] = {"idx": i}
        if images:
            vis = image_processor()(images=images, return_tensors="pt")
            grid = vis["image_grid_thw"]
            parts = prompt.split(pad)
            prompt = parts[0] + "".join(
                pad * n + rest for n, rest in zip(visual_tokens(grid), parts[1:], strict=True)
            )
            out["pixel_values"] = vis["pixel_values"]
            out["image_grid_thw"] = grid
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(answer, add_special_tokens=False)["input_ids"]
        ids = (p_ids + a_ids)[: self.max_len]
        if len(p_ids) >= self.max_len:
            raise ValueError(
                f"sample {i}: its prompt alone is {len(p_ids)} tokens, over max_len={self.max_len}"
            )
        input_ids = torch.tensor(ids, dtype=torch.long)
        labels = input_ids.clone()
        labels[: len(p_ids)] = -100
        out["input_ids"] = input_ids
        out["labels"] = labels
        return out
