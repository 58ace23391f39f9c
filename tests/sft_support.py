"""SFT helpers for the gradient-equality tests: a chat-like dataset with masked
prompt labels, padded and packed collation, a tiny seeded Llama, and the
single-process reference gradient.

A sample is `[BOS] prompt [SEP] response [EOS]`; its labels are its input ids
with the prompt part (BOS, prompt, SEP) set to -100, as an SFT chat template
does. So a sample's cost (`len(input_ids)`) and its loss tokens
(`labels[1:] != -100`: the response and EOS) differ, and by a different ratio
for every sample: a loss normalised by cost tokens is not the per-token mean.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

from odb_core.torch import collate

PAD, BOS, SEP, EOS = 0, 1, 2, 3
VOCAB = 128
FIRST_WORD = 4
IGNORE = -100


class ChatSFT(Dataset[dict[str, torch.Tensor]]):
    """`n` chat samples with long-tailed prompt and response lengths.

    `skew`: even indices are about three times longer than odd ones, so with the
    loader's round-robin split of an unshuffled order rank 0 (even positions) holds
    far more tokens than rank 1, which runs out first and pads.
    `masked_every=k`: every k-th sample has its response masked too (a sample
    with no loss token at all, e.g. a turn truncated away).
    """

    def __init__(self, n: int, *, seed: int = 0, skew: bool = False, masked_every: int = 0) -> None:
        self.n = n
        self.seed = seed
        self.skew = skew
        self.masked_every = masked_every

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        rng = random.Random(self.seed * 1_000_003 + i)
        prompt_len = min(96, max(2, int(rng.lognormvariate(2.7, 0.7))))
        response_len = min(64, max(1, int(rng.lognormvariate(2.2, 0.8))))
        if self.skew and i % 2 == 0:
            prompt_len, response_len = 3 * prompt_len, 3 * response_len
        words = VOCAB - FIRST_WORD
        prompt = [FIRST_WORD + rng.randrange(words) for _ in range(prompt_len)]
        response = [FIRST_WORD + (prompt[-1] * 3 + 1) % words]
        for _ in range(response_len - 1):  # a learnable chain, so the example's loss falls
            response.append(FIRST_WORD + (response[-1] * 5 + 7) % words)
        ids = torch.tensor([BOS, *prompt, SEP, *response, EOS])
        labels = ids.clone()
        labels[: prompt_len + 2] = IGNORE
        if self.masked_every and i % self.masked_every == self.masked_every - 1:
            labels[:] = IGNORE
        return {"input_ids": ids, "labels": labels}


def loss_tokens(sample: Mapping[str, torch.Tensor]) -> int:
    """Tokens whose loss counts under a causal LM's one-token label shift."""
    return int((sample["labels"][1:] != IGNORE).sum())


def pad_collate(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad: input_ids with PAD, labels with -100, and an attention mask."""
    return collate.pad_collate(samples, pad_token_id=PAD, ignore_index=IGNORE)


def pack_collate(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The library's packed row, without its `use_cache` key (tiny_llama's config
    already has use_cache=False; these tests move batches as dicts of tensors)."""
    out: dict[str, torch.Tensor] = collate.pack_collate(
        samples, ignore_index=IGNORE, use_cache_key=False
    )
    return out


COLLATES = {"padded": pad_collate, "packed": pack_collate}


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    """A 2-layer random-init LlamaForCausalLM (about 27k parameters), the same on
    every process for the same seed. float64, so 1e-6 comparisons are meaningful.
    `use_cache=False` in the config: a packed row must not build a KV cache (with
    one, transformers does not split the row into its sequences)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        use_cache=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


def lora_llama(seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    """`tiny_llama(seed)` under PEFT LoRA (rank 4 on the attention projections): only
    the adapter weights train. Both adapter matrices random (`init_lora_weights=False`;
    PEFT's default zero B would give A a zero gradient, a weaker check)."""
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(seed, dtype)
    torch.manual_seed(seed + 1)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    return get_peft_model(model, config).to(dtype)


MODELS = {"full": tiny_llama, "lora": lora_llama}


def flat_grad(module: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flattened in parameter order (zeros where None)."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
            for p in module.parameters()
        ]
    ).clone()


def sample_grad(model: Any, sample: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Gradient of the *sum* of one sample's token cross-entropy over its unmasked
    shifted labels (no padding, no packing: the sample alone), and its loss tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one tiny sample: more threads only contend (30x slower here)
    try:
        model.zero_grad(set_to_none=True)
        ids, labels = sample["input_ids"], sample["labels"]
        logits = model(input_ids=ids[None]).logits[0]
        ce = F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE, reduction="sum")
        ce.backward()
        grad = flat_grad(model)
        model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    return grad, loss_tokens(sample)


class Reference:
    """Single-process per-sample gradients of one dataset, computed once each."""

    def __init__(self, model: Any, dataset: Dataset[dict[str, torch.Tensor]]) -> None:
        self.model = model
        self.dataset = dataset
        self._cache: dict[int, tuple[torch.Tensor, int]] = {}

    def grad(self, i: int) -> tuple[torch.Tensor, int]:
        if i not in self._cache:
            self._cache[i] = sample_grad(self.model, self.dataset[i])
        return self._cache[i]

    def cost(self, i: int) -> int:
        return len(self.dataset[i]["input_ids"])

    def summed(self, ids: Iterable[int]) -> tuple[torch.Tensor, int]:
        """(Σ of the samples' summed-CE gradients, Σ of their loss tokens)."""
        total: torch.Tensor | None = None
        tokens = 0
        for i in ids:
            g, n = self.grad(i)
            total = g.clone() if total is None else total + g
            tokens += n
        if total is None:
            raise ValueError("no samples")
        return total, tokens

    def mean(self, ids: Iterable[int]) -> torch.Tensor:
        """The per-token mean gradient over exactly these samples."""
        total, tokens = self.summed(ids)
        return total / tokens


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())
