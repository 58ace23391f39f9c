"""The workload of `odb bench --model`: the model sizes, a seeded long-tail SFT
dataset whose `__getitem__` does the preprocessing, the bench's collator, and the
Llama built from a config (no download)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

# (layers, hidden, intermediate, heads, kv heads, vocab)
SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "llama-tiny": (2, 128, 256, 4, 2, 1024),
    "llama-small": (4, 256, 688, 8, 4, 4096),
    "llama-100m": (12, 768, 2048, 12, 4, 32000),
}
MIN_LEN = 16
PROMPT_SHARE = 4  # the first len // 4 tokens are a masked prompt


def lengths(n: int, max_len: int, seed: int) -> list[int]:
    """Long-tailed (log-normal, median max_len / 8) lengths clipped to [16, max_len]."""
    rng = random.Random(seed)
    mu = math.log(max(MIN_LEN, max_len / 8))
    return [max(MIN_LEN, min(max_len, int(rng.lognormvariate(mu, 1.0)))) for _ in range(n)]


class LongTailText(Dataset[dict[str, Any]]):
    """Map-style dataset; `__getitem__` does the preprocessing (token by token, a
    tokeniser stand-in): a prompt of random words, then a response that follows a
    per-sample rule a model can learn; labels mask the prompt."""

    def __init__(self, n: int, max_len: int, vocab: int, seed: int, rule: int = 5) -> None:
        self.lengths = lengths(n, max_len, seed)
        self.vocab = vocab
        self.seed = seed
        self.rule = rule  # the response rule's multiplier: another value, another distribution

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:

        n = self.lengths[i]
        rng = random.Random(self.seed * 1_000_003 + i)
        words = self.vocab - 4
        step = 1 + rng.randrange(7)
        prompt = n // PROMPT_SHARE
        ids = [1 + rng.randrange(3)]
        for t in range(1, n):
            prev = ids[-1]
            ids.append(
                4 + rng.randrange(words) if t < prompt else 4 + (prev * self.rule + step) % words
            )
        input_ids = torch.tensor(ids, dtype=torch.long)
        labels = input_ids.clone()
        labels[:prompt] = -100
        return {"input_ids": input_ids, "labels": labels, "idx": i}


class BenchCollate:
    """The library's collator, plus the batch's ids and its own collate time."""

    def __init__(self, packed: bool) -> None:
        self.packed = packed

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:

        from odb_core.torch.collate import pack_collate, pad_collate

        start = time.perf_counter()
        core = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples]
        out: dict[str, Any] = pack_collate(core) if self.packed else pad_collate(core)
        out["bench_ids"] = torch.tensor([int(s["idx"]) for s in samples], dtype=torch.long)
        out["bench_collate_s"] = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        return out


def build_model(size: str, max_len: int, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from odb_core.torch.collate import use_packed_attention

    layers, hidden, inter, heads, kv, vocab = SIZES[size]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max(2048, max_len),
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return use_packed_attention(model)  # SDPA for padded rows, per-sample SDPA for packed


class TextWorkload:
    """What a bench rank (`model_setup.RankSetup`) needs of a workload, for the text set."""

    text_only = True
    find_unused_parameters = False

    def __init__(self, size: str, max_len: int) -> None:
        self.size = size
        self.max_len = max_len

    def dataset(self, n: int, seed: int) -> LongTailText:
        return LongTailText(n, self.max_len, SIZES[self.size][5], seed)

    def pretrain_dataset(self, n: int, seed: int) -> LongTailText:
        """The fine-tuning regime's other distribution: another response rule."""
        return LongTailText(n, self.max_len, SIZES[self.size][5], seed, rule=3)

    def pretrain_collate(self) -> BenchCollate:
        return BenchCollate(False)

    def model(self, seed: int) -> Any:
        return build_model(self.size, self.max_len, seed)

    def collate(self, packed: bool) -> BenchCollate:
        return BenchCollate(packed)

    def vision_tower(self, model: Any) -> Any:
        return None

    def eval_batch(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """A held-out chunk packed into one row (labels included)."""
        from odb_core.torch.collate import pack_collate

        return pack_collate(
            [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples],
            use_cache_key=False,
        )
