"""`odb bench --model qwen3-vl-tiny`: the synthetic multimodal mix (determinism,
visual tokens that follow image sizes, decode errors), LLaVA's modality grouping,
and one tiny end-to-end run on 2 gloo ranks (marked procs). Figures are not
asserted: only the bench's own checks and its schema."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from typing import Any

import pytest
from guards import HANG_GUARD_S

pytest.importorskip("transformers")
pytest.importorskip("PIL")

import torch

from odb_core.bench.vlm_data import Kind, RawSample
from odb_core.bench.vlm_grouped import grouped_estimate_plan, modality_order
from odb_core.bench.vlm_preprocess import VLMSFT, SampleDecodeError, token_id

ODB = [sys.executable, "-c", "import sys; from odb_core.cli import main; sys.exit(main())"]


def _png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 40, 40)).save(buf, format="PNG")
    return buf.getvalue()


def _one_image(ds: VLMSFT, w: int, h: int) -> int:
    """Image tokens of sample 0 re-stored with one w x h image."""
    ds.raw[0] = RawSample(Kind.OCR_VQA, (_png(w, h),), ("red",), "what colour", "red")
    s = ds[0]
    assert s["image_grid_thw"].shape == (1, 3)
    return int((s["input_ids"] == token_id("<|image_pad|>")).sum())


def test_the_mix_is_deterministic_per_seed() -> None:
    a, b, c = VLMSFT(12, 1024, 3), VLMSFT(12, 1024, 3), VLMSFT(12, 1024, 4)
    assert [r.images for r in a.raw] == [r.images for r in b.raw]
    for i in range(12):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["labels"], y["labels"])
        assert ("pixel_values" in x) == ("pixel_values" in y)
        if "pixel_values" in x:
            assert torch.equal(x["pixel_values"], y["pixel_values"])
    assert [len(a[i]["input_ids"]) for i in range(12)] != [
        len(c[i]["input_ids"]) for i in range(12)
    ]


def test_the_pretraining_mix_changes_only_the_answers_rule() -> None:
    """The fine-tuning regime's first training: the same kinds, images, questions
    and colour words as the fine-tuning mix of that seed, the answers under
    another rule; the default rule is the one the bench always had (5)."""
    from odb_core.bench.vlm_data import MixParams, raw_sample
    from odb_core.bench.vlm_workload import VLMWorkload

    pre = VLMWorkload("tiny", 1024).pretrain_dataset(40, 3)
    fine = VLMSFT(40, 1024, 3)
    assert [r.answer for r in fine.raw] == [
        raw_sample(3, i, MixParams(answer_rule=5)).answer for i in range(40)
    ]
    differ = 0
    for a, b in zip(pre.raw, fine.raw, strict=True):
        assert (a.kind, a.images, a.colours, a.question) == (
            b.kind,
            b.images,
            b.colours,
            b.question,
        )
        x, y = a.answer.split(), b.answer.split()
        assert len(x) == len(y) and x[: len(a.colours) + 1] == y[: len(b.colours) + 1]
        differ += x != y
    assert differ >= 20  # every answer past its first rule word follows the other rule


def test_visual_tokens_follow_image_size() -> None:
    ds = VLMSFT(1, 1024, 0)
    # 16 px patches merged 2 x 2: one token per 32 x 32 px, sides rounded to 32
    assert _one_image(ds, 64, 64) == 4
    assert _one_image(ds, 320, 160) == 10 * 5
    assert _one_image(ds, 512, 512) == 256
    assert _one_image(ds, 2000, 2000) == 256  # capped by max_pixels (512 x 512)
    s = ds[0]
    pad = token_id("<|image_pad|>")
    n = int((s["input_ids"] == pad).sum())
    assert s["pixel_values"].shape[0] == 4 * n  # patches = tokens x merge^2
    assert bool((s["labels"][s["input_ids"] == pad] == -100).all())  # the prompt is masked
    assert int((s["labels"] != -100).sum()) > 0


def test_an_image_that_does_not_decode_names_its_sample() -> None:
    ds = VLMSFT(3, 1024, 0)
    ds.raw[2] = dataclasses.replace(ds.raw[2], images=(b"not an image",), colours=("red",))
    with pytest.raises(SampleDecodeError, match="sample 2: an image does not decode"):
        ds[2]


def test_modality_grouping_keeps_modalities_apart_and_every_id_once() -> None:
    lens = [(-(5 + i % 7) if i % 5 == 0 else 10 + i % 13) for i in range(103)]
    order = modality_order(lens, batch_size=4, world=2, seed=1)
    assert sorted(order) == list(range(103))
    mega = 8
    full = order[: len(order) - (len(order) % mega or mega)]
    for s in range(0, len(full) - mega + 1, mega):
        signs = {lens[i] > 0 for i in order[s : s + mega]}
        assert len(signs) == 1, order[s : s + mega]  # a megabatch holds one modality
    plan = grouped_estimate_plan(lens, 4, 2, 1)
    assert len(plan[0]) == len(plan[1])
    assert {i for p in plan for b in p for i in b} == set(range(103))
    with pytest.raises(ValueError, match="non-zero"):
        modality_order([3, 0, -2], 1, 1, 0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--regime", "finetune", "--quality", "--lora"], "--regime finetune with --lora"),
    ],
)
def test_vlm_options_fail_clearly(
    args: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from odb_core.cli import main

    assert main(["bench", "--model", "qwen3-vl-tiny", *args]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--strategies", "grouped-estimate"], "groups by modality: it needs a VLM"),
        (["--lora"], "--lora is for a VLM --model"),
    ],
)
def test_vlm_only_options_refuse_a_text_model(
    args: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from odb_core.cli import main

    assert main(["bench", "--model", "llama-tiny", *args]) == 2
    assert match in capsys.readouterr().err


def _packed_sample_losses(
    model: Any, samples: list[dict[str, Any]], use_cache: bool
) -> list[float]:
    """Each sample's summed token cross-entropy read from the bench's packed row."""
    from odb_core.bench.vlm_workload import VLMCollate, rope_index
    from odb_core.torch.collate import packed_segments

    batch = VLMCollate(rope_index("qwen3-vl-tiny"))(samples)
    for key in ("bench_ids", "bench_collate_s", "use_cache"):
        batch.pop(key)
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch, use_cache=use_cache).logits
    segments = packed_segments(batch["position_ids"][0])[0]
    assert [e - s for s, e in segments] == [len(x["input_ids"]) for x in samples]
    return [_ce(logits[0, s:e], labels[0, s:e]) for s, e in segments]


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> float:
    ce = torch.nn.functional.cross_entropy
    return float(ce(logits[:-1], labels[1:], ignore_index=-100, reduction="sum"))


def test_the_bench_packs_each_sample_on_its_own() -> None:
    """odb-packed's rows (the bench's model, collate and data, float64): each
    sample's loss read from the packed row equals its loss alone, with and without
    images. The broken variant, plain SDPA with a KV cache (transformers then
    builds no per-sample mask), attends across samples and misses; the bench's
    `check_packed_model` refuses that model."""
    from odb_core.bench.vlm_workload import VLMWorkload
    from odb_core.errors import ConfigError
    from odb_core.torch.collate import check_packed_model

    wl = VLMWorkload("qwen3-vl-tiny", 1024)
    ds = wl.dataset(40, 0)
    images = [i for i, r in enumerate(ds.raw) if r.kind == Kind.OCR_VQA]  # the short ones
    text = [i for i, r in enumerate(ds.raw) if r.kind == Kind.TEXT]
    samples = [ds[i] for i in (images[0], text[0], images[1])]
    model = wl.model(0).to(torch.float64).eval()
    alone = []
    for s in samples:
        b = wl.eval_batch([s])
        labels = b.pop("labels")
        with torch.no_grad():
            alone.append(_ce(model(**b, use_cache=False).logits[0], labels[0]))
    check_packed_model(model)
    for got, want in zip(_packed_sample_losses(model, samples, True), alone, strict=True):
        assert abs(got - want) <= 1e-9 * abs(want)
    model.set_attn_implementation("sdpa")
    crossed = _packed_sample_losses(model, samples, True)
    assert max(abs(a - b) / b for a, b in zip(crossed[1:], alone[1:], strict=True)) > 1e-4
    with pytest.raises(ConfigError, match="attend across samples"):
        check_packed_model(model, {"use_cache": True})


@pytest.mark.procs
def test_tiny_vlm_run_every_strategy_reports() -> None:
    strategies = ["standard", "grouped", "grouped-estimate", "gmt", "odb-padded", "odb-packed"]
    cmd = [
        *ODB, "bench", "--model", "qwen3-vl-tiny", "--samples", "16", "--max-len", "1024",
        "--budget", "2048", "--repeats", "1", "--eval-samples", "2", "--workers", "1",
        "--timeout", str(HANG_GUARD_S), "--json", "--strategies", ",".join(strategies),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["ok"] is True
    assert list(r["strategies"]) == strategies
    for name, row in r["strategies"].items():
        assert row["runs"][0]["samples"] == 16, name  # every strategy ran the whole epoch
        assert row["equal_steps"] and row["exactly_once"], name
        assert len(set(row["steps_per_rank"])) == 1, name
        assert row["runs"][0]["unique_ids"] == 16, name
        assert row["peak_rss_mb"] > 0 and len(row["runs"][0]["peak_rss_mb_per_rank"]) == 2
        assert row["vision_forward_s"] > 0, name
    rows = r["strategies"]
    assert rows["odb-packed"]["padding"] == 0.0  # one packed row per step
    assert rows["grouped"]["precompute_s"] > 0 and rows["gmt"]["precompute_s"] > 0
    assert rows["grouped-estimate"]["precompute_s"] == 0  # no pass: lengths from the text
    assert {"odb-padded/grouped-estimate", "odb-padded/grouped_incl_length_pass"} <= set(
        r["ratios"]
    )
    # What each odb-core loader ran with, as its describe() says.
    assert rows["odb-packed"]["loader"]["sharding"] == "dynamic"
    assert rows["odb-padded"]["loader"]["sharding"] == "static"
    assert "cost_model='padded'" in rows["odb-padded"]["loader"]["sharding_reason"]
    assert "loader" not in rows["standard"]


@pytest.mark.procs
def test_finetune_regime_pretrains_one_model_every_strategy_starts_from() -> None:
    """`--regime finetune` on the VLM: each seed's model is first trained on the
    other rule's mix, and every strategy starts from that model (the same held-out
    loss before its first update), which is not the random init (a scratch run's)."""
    base = [
        *ODB, "bench", "--model", "qwen3-vl-tiny", "--samples", "16", "--max-len", "1024",
        "--budget", "2048", "--repeats", "1", "--eval-samples", "4", "--workers", "0",
        "--quality", "--epochs", "1", "--strategies", "standard,odb-linear-lr", "--json",
    ]  # fmt: skip
    starts = {}
    for regime in ("scratch", "finetune"):
        cmd = [*base, "--regime", regime, "--pretrain-samples", "48"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        r = json.loads(out.stdout)
        assert r["ok"] is True and r["quality"]["regime"] == regime
        first = {n: row["runs"][0]["curve"][0][2] for n, row in r["strategies"].items()}
        assert first["standard"] == pytest.approx(first["odb-linear-lr"], rel=1e-9), first
        starts[regime] = first["standard"]
    assert starts["finetune"] < starts["scratch"] - 0.05, starts


@pytest.mark.parametrize("lora", [True, False])
def test_lora_trains_only_the_adapters(lora: bool) -> None:
    """`--lora`: one optimizer step of the bench's model on a packed batch changes
    `lora_` weights (on the language model's attention projections) and nothing
    else. The full-FT model is the variant that changes more: the check can fail."""
    from odb_core.bench.vlm_workload import VLMWorkload

    wl = VLMWorkload("qwen3-vl-tiny", 1024, lora=lora)
    ds = wl.dataset(12, 0)
    images = [i for i, r in enumerate(ds.raw) if r.kind == Kind.OCR_VQA]
    model = wl.model(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = wl.collate(True)([ds[images[0]], ds[images[1]]])
    for key in ("bench_ids", "bench_collate_s", "use_cache"):
        batch.pop(key)
    labels = batch.pop("labels")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logits = model(**batch, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:]).backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    only_lora = {n for n in changed if "lora_" in n}
    if not lora:
        assert changed - only_lora
        return
    assert changed and changed == only_lora, sorted(changed - only_lora)[:3]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in before if "lora_" in n}
    assert all(".language_model." in n and ".self_attn." in n for n in trainable)
    assert {n.split(".self_attn.")[1].split(".")[0] for n in trainable} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    }
