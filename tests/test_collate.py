"""The padded and packed collators: a packed (or padded) forward equals each sample's
own forward, for a tiny LlamaForCausalLM with sdpa, eager and the varlen attention."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from odb_core import ConfigError  # noqa: E402
from odb_core.torch import (  # noqa: E402
    StepMeta,
    causal_lm_loss,
    check_packed_model,
    pack_collate,
    pad_collate,
    use_packed_attention,
)
from odb_core.torch.collate import packed_segments  # noqa: E402

LENGTHS = (5, 17, 1, 40, 9)
TOL = 1e-5


def tiny(impl: str, dtype: torch.dtype, use_cache: bool = False) -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        use_cache=use_cache,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    if impl == "varlen":
        use_packed_attention(model)
    else:
        model.set_attn_implementation(impl)
    return model


def samples() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, 97, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = -100  # a masked prompt
        out.append({"input_ids": ids, "labels": labels})
    return out


def per_sample_logits(model: object, ss: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    return [model(input_ids=s["input_ids"][None]).logits[0] for s in ss]  # type: ignore[operator]


def forward(model: object, batch: dict[str, object]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs).logits  # type: ignore[operator, no-any-return]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("impl", ["sdpa", "eager", "varlen"])
def test_packed_forward_equals_per_sample(impl: str, dtype: torch.dtype) -> None:
    model = tiny(impl, dtype, use_cache=True)  # the batch's use_cache=False must win
    ss = samples()
    batch = pack_collate(ss)
    assert batch["use_cache"] is False
    check_packed_model(model, batch)
    with torch.no_grad():
        packed = forward(model, batch)[0].split(list(LENGTHS))
        for got, want in zip(packed, per_sample_logits(model, ss), strict=True):
            assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("impl", ["sdpa", "varlen"])
def test_padded_forward_equals_per_sample(impl: str) -> None:
    model = tiny(impl, torch.float64)
    ss = samples()
    batch = pad_collate(ss)
    assert batch["input_ids"].shape == (len(LENGTHS), max(LENGTHS))
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    with torch.no_grad():
        logits = forward(model, batch)
        for row, want in enumerate(per_sample_logits(model, ss)):
            got = logits[row, : LENGTHS[row]]
            assert (got - want).abs().max().item() < TOL


def test_use_cache_crosses_samples_and_is_caught() -> None:
    model = tiny("sdpa", torch.float64, use_cache=True)
    ss = samples()
    batch = pack_collate(ss, use_cache_key=False)
    with pytest.raises(ConfigError, match="use_cache"):
        check_packed_model(model, batch)
    with torch.no_grad():
        crossed = forward(model, batch)[0].split(list(LENGTHS))
        want = per_sample_logits(model, ss)
    assert max((c - w).abs().max().item() for c, w in zip(crossed, want, strict=True)) > 1e-3
    use_packed_attention(model)  # segment-wise attention: right with a cache too
    check_packed_model(model, batch)
    with torch.no_grad():
        fixed = forward(model, batch)[0].split(list(LENGTHS))
    assert max((f - w).abs().max().item() for f, w in zip(fixed, want, strict=True)) < TOL


def test_packed_labels_and_loss() -> None:
    model = tiny("varlen", torch.float64)
    ss = samples()
    batch = pack_collate(ss)
    labels = batch["labels"][0]
    starts = [0]
    for n in LENGTHS[:-1]:
        starts.append(starts[-1] + n)
    assert (labels[starts] == -100).all()
    assert packed_segments(batch["position_ids"]) == [
        [(s, s + n) for s, n in zip(starts, LENGTHS, strict=True)]
    ]
    loss_tokens = [int((s["labels"][1:] != -100).sum()) for s in ss]
    assert int((labels != -100).sum()) == sum(loss_tokens)
    with torch.no_grad():
        packed_loss = model(**batch).loss  # type: ignore[operator]
        sums = [
            torch.nn.functional.cross_entropy(
                lg[:-1], s["labels"][1:], ignore_index=-100, reduction="sum"
            )
            for lg, s in zip(per_sample_logits(model, ss), ss, strict=True)
        ]
    assert abs(packed_loss.item() - (sum(sums) / sum(loss_tokens)).item()) < 1e-6  # HF: float32 CE

    # per-sample normalisation of a packed row: each sample's mean, not the row's
    meta = StepMeta(0, 0, False, True, 1, 1, len(ss), len(ss), 0, 0, len(ss), 0)
    with torch.no_grad():
        logits = forward(model, batch)
    got = causal_lm_loss(meta, logits, batch["labels"], position_ids=batch["position_ids"])
    want = sum(s / n for s, n in zip(sums, loss_tokens, strict=True) if n) / len(ss)
    assert abs(got.item() - float(want)) < 1e-6
    row_mean = causal_lm_loss(meta, logits, batch["labels"])
    assert abs(row_mean.item() - float(want)) > 1e-3  # without position_ids: one sample per row


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([], "non-empty list"),
        ([{"labels": torch.ones(3, dtype=torch.long)}], "input_ids"),
        ([{"input_ids": torch.ones(2, 3, dtype=torch.long)}], "1-D integer"),
        ([{"input_ids": torch.ones(3)}], "1-D integer"),
        ([{"input_ids": torch.ones(0, dtype=torch.long)}], "non-empty 1-D"),
        ([{"input_ids": torch.ones(3, dtype=torch.long), "labels": torch.ones(2)}], "labels"),
    ],
)
def test_bad_inputs_raise(bad: list[dict[str, torch.Tensor]], match: str) -> None:
    for fn in (pack_collate, pad_collate):
        with pytest.raises(ValueError, match=match):
            fn(bad)


def test_not_a_transformers_model() -> None:
    with pytest.raises(ConfigError, match="transformers"):
        use_packed_attention(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="transformers"):
        check_packed_model(torch.nn.Linear(2, 2))


def test_varlen_rows_and_gradients_equal_per_sample() -> None:
    model = tiny("varlen", torch.float64)
    g = torch.Generator().manual_seed(2)
    rows = [(5, 17, 10), (16, 16)]  # two rows of 32 tokens, no attention mask
    ss = [[{"input_ids": torch.randint(0, 97, (n,), generator=g)} for n in r] for r in rows]
    packed = [pack_collate(r) for r in ss]
    batch = {
        "input_ids": torch.cat([p["input_ids"] for p in packed]),
        "position_ids": torch.cat([p["position_ids"] for p in packed]),
    }
    model.zero_grad()
    logits = model(**batch).logits  # type: ignore[operator]
    logits.sum().backward()
    got_grad = [p.grad.clone() for p in model.parameters()]  # type: ignore[attr-defined]
    model.zero_grad()  # type: ignore[attr-defined]
    want_sum = 0.0
    for b, r in enumerate(ss):
        pieces = logits[b].split([len(s["input_ids"]) for s in r])
        for piece, want in zip(pieces, per_sample_logits(model, r), strict=True):
            assert (piece - want).abs().max().item() < TOL
            want_sum = want_sum + want.sum()
    want_sum.backward()  # type: ignore[union-attr]
    for got, p in zip(got_grad, model.parameters(), strict=True):  # type: ignore[attr-defined]
        assert torch.allclose(got, p.grad, rtol=1e-9, atol=1e-10)
