"""The data and model the SFT examples share: a chat-like dataset whose prompt
labels are masked, the library's collators bound to its pad token, and a tiny
random-init Llama.

The examples run as scripts (`torchrun examples/train_sft.py`), so Python puts
this folder first on `sys.path` and `from sft_data import ...` finds this file.

A sample is `[BOS] prompt [SEP] response [EOS]`; its labels are its input ids
with the prompt part (BOS, prompt, SEP) set to -100, as an SFT chat template
does. Lengths are long-tailed and known only once a sample is built (as after
templating); the response is a chain seeded by the prompt, so the loss falls.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from odb_core.torch import collate

PAD, BOS, SEP, EOS = 0, 1, 2, 3
VOCAB = 128
FIRST_WORD = 4
IGNORE = collate.IGNORE_INDEX


@dataclass(frozen=True)
class LogNormal:
    """A length drawn as `int(lognormvariate(mu, sigma))`, clamped to [low, high]."""

    mu: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return min(self.high, max(self.low, int(rng.lognormvariate(self.mu, self.sigma))))


@dataclass(frozen=True)
class Lengths:
    """How long a sample's prompt and response are."""

    prompt: LogNormal
    response: LogNormal


#: train_sft, hf_trainer_sft, lightning_sft: prompts up to 384, responses up to 256.
LONG = Lengths(LogNormal(3.2, 0.8, 2, 384), LogNormal(2.8, 0.8, 1, 256))
#: accelerate_sft.
MEDIUM = Lengths(LogNormal(3.0, 0.8, 2, 256), LogNormal(2.6, 0.8, 1, 192))
#: fsdp2_sft (whose uneven mode triples the even samples).
SHORT = Lengths(LogNormal(2.8, 0.7, 2, 128), LogNormal(2.4, 0.8, 1, 96))


class ChatSFT(Dataset[dict[str, torch.Tensor]]):
    """`n` chat samples; sample i is drawn from `random.Random(i)` (the same on
    every rank and worker). `uneven`: even-numbered samples are 3x longer, so the
    ranks' shards hold very different token counts."""

    def __init__(self, n: int, lengths: Lengths = LONG, *, uneven: bool = False) -> None:
        self.n = n
        self.lengths = lengths
        self.uneven = uneven

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} of a dataset of {self.n}")
        rng = random.Random(i)
        prompt_len = self.lengths.prompt.draw(rng)
        response_len = self.lengths.response.draw(rng)
        if self.uneven and i % 2 == 0:
            prompt_len, response_len = 3 * prompt_len, 3 * response_len
        words = VOCAB - FIRST_WORD
        prompt = [FIRST_WORD + rng.randrange(words) for _ in range(prompt_len)]
        response = [FIRST_WORD + (prompt[-1] * 3 + 1) % words]
        for _ in range(response_len - 1):  # learnable: a chain seeded by the prompt
            response.append(FIRST_WORD + (response[-1] * 5 + 7) % words)
        ids = torch.tensor([BOS, *prompt, SEP, *response, EOS])
        labels = ids.clone()
        labels[: prompt_len + 2] = IGNORE  # no loss on the prompt
        return {"input_ids": ids, "labels": labels}


def pad_collate(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`odb_core.torch.pad_collate` with this vocabulary's PAD: right-padded
    `input_ids`, `labels` (-100 on padding) and an `attention_mask`. A module-level
    function, so DataLoader workers can pickle it."""
    return collate.pad_collate(samples, pad_token_id=PAD, ignore_index=IGNORE)


def pack_collate(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`odb_core.torch.pack_collate`: one row, position ids restarting per sample
    (attention stays within each sample), each sample's first label masked. No
    `use_cache` key: `tiny_llama`'s config already has use_cache=False, and the
    batch stays a dict of tensors."""
    out: dict[str, torch.Tensor] = collate.pack_collate(
        samples, ignore_index=IGNORE, use_cache_key=False
    )
    return out


def tiny_llama(max_positions: int = 1024) -> Any:
    """A 2-layer random-init `LlamaForCausalLM`, the same on every rank (seed 0).
    `use_cache=False`: training; a packed row must not build a KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        use_cache=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)
