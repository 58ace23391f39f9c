"""`ODBHFTrainer` on the paper's own workload: transformers' own Qwen3-VL (tiny,
float64, random init), full fine-tuning and PEFT LoRA, on 2 real gloo ranks.

Each scenario runs `trainer.train()` (transformers' own loop; DDP set up by
transformers/accelerate on an initialised gloo group) over samples with 0-2 images
each (pixel patches and `image_grid_thw` as the Qwen-VL image processor emits them,
prompts and images label-masked, every 7th answer empty in `*_g2`), learning rate
0, so every window is compared against the seeded init. A callback records, at
every `on_pre_optimizer_step`, the window's sample ids on each rank and the
gradient DDP left. The parent computes, on one process, each sample alone and
positioned by the model itself (its own `get_rope_index`), the per-token mean
gradient over the window's samples; the two must agree within 1e-6 relative L2 in
every window:

- `packed_g2`: `VLMPackCollate` (one row, each sample's own 3-D positions) on
  `use_packed_attention`, packed cost, `gradient_accumulation_steps=2`;
- `padded_g1`: `vlm_pad_collate` (the model positions the rows), padded cost, G=1;
- `lora_packed_g2`, `lora_padded_g1`: the same under LoRA on the language model's
  q/k/v/o; the vision tower, merger and base weights get no gradient.

`ddp_find_unused_parameters` is left unset: the adapter turns it on for a model
with a vision tower, so a text-only step followed by an image step trains.

Each check can fail: on the same samples, the normalisations the Trainer would
give without the loader's scale (each micro-step's own mean over G; each rank's
own mean, averaged by DDP) miss the reference by more than 1e-4.
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from gloo_ranks import launch_entry, set_rank_env  # noqa: E402
from guards import HANG_GUARD_S  # noqa: E402
from sft_support import Reference, flat_grad, loss_tokens, rel_l2  # noqa: E402
from trainer_windows import WindowRecorder  # noqa: E402
from vlm_fixtures import (  # noqa: E402
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VLMSet,
    image_mix,
    one_sample_batch,
    tiny_qwen3_vl,
    with_lora,
)

from odb_core.bench.launch import init_local_gloo, release_child_resources  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.procs, pytest.mark.slow]

WORLD = 2
TOL = 1e-6
WRONG = 1e-4

SCENARIOS: dict[str, dict[str, Any]] = {
    "packed_g2": {
        "data": {"n": 24, "seed": 1, "masked_every": 7},
        "packed": True,
        "odb": {"cost_model": "packed", "token_budget": 64, "seed": 3},
        "accum": 2,
    },
    "padded_g1": {
        "data": {"n": 20, "seed": 2},
        "packed": False,
        "odb": {"cost_model": "padded", "token_budget": 64, "seed": 4},
        "accum": 1,
    },
}
for _name in ("packed_g2", "padded_g1"):
    SCENARIOS[f"lora_{_name}"] = {**SCENARIOS[_name], "lora": True}

COMMON_ODB = {"deterministic": True, "buffer_size": 8, "max_steps_per_round": 4}


def dataset(name: str) -> VLMSet:
    data = SCENARIOS[name]["data"]
    return VLMSet(image_mix(data["n"], data["seed"]), masked_every=data.get("masked_every", 0))


def model_for(name: str, packed: bool = False) -> Any:
    model = tiny_qwen3_vl(seed=0)
    if packed:
        from odb_core.torch.collate import use_packed_attention

        use_packed_attention(model)
    return with_lora(model) if SCENARIOS[name].get("lora") else model


class PadCollate:
    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        from odb_core.torch.vlm import vlm_pad_collate

        return vlm_pad_collate(samples, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN)


# ---- what runs inside a rank ----------------------------------------------------------


def run(name: str, out: Path) -> dict[str, Any]:
    from transformers import TrainingArguments

    from odb_core.integrations.hf import ODBArguments, ODBHFTrainer
    from odb_core.torch.vlm import MRopeIndex, VLMPackCollate

    sc = SCENARIOS[name]
    model = model_for(name, packed=sc["packed"])
    base = model.get_base_model() if sc.get("lora") else model
    collate = VLMPackCollate(MRopeIndex.from_model(base)) if sc["packed"] else PadCollate()
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        save_strategy="no",
        max_grad_norm=0.0,
        weight_decay=0.0,
        learning_rate=0.0,
        num_train_epochs=1,
        gradient_accumulation_steps=sc["accum"],
        seed=0,
    )
    rec = WindowRecorder()
    trainer = ODBHFTrainer(
        model=model,
        args=args,
        train_dataset=dataset(name),
        data_collator=collate,
        odb=ODBArguments(**{**COMMON_ODB, **sc["odb"]}),
        callbacks=[rec],
    )
    rec.trainer = trainer
    t0 = time.perf_counter()
    trainer.train()
    return {
        "windows": rec.windows,
        "find_unused": trainer.args.ddp_find_unused_parameters,
        "time": time.perf_counter() - t0,
    }


def _rank_entry(rank: int, world: int, port: int, out: str) -> None:
    set_rank_env(rank, world, port, OMP_NUM_THREADS="1")
    init_local_gloo(rank, world, port, timeout_s=HANG_GUARD_S)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        root = Path(out)
        result = {name: run(name, root / name) for name in SCENARIOS}
        torch.save(result, root / f"rank{rank}.pt")
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
    release_child_resources()
    os._exit(0)


# ---- the parent's view ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    out = launch_entry(_rank_entry, WORLD, tmp_path_factory.mktemp("vlm_hf"), timeout=HANG_GUARD_S)
    times = {k: round(v["time"], 1) for k, v in out[0].items()}
    print(f"\nvlm hf launch {time.perf_counter() - t0:.1f}s; per run {times}")
    return out


class VLMReference(Reference):
    """Each sample alone, positioned by the model itself, its images included."""

    def grad(self, i: int) -> tuple[torch.Tensor, int]:
        if i not in self._cache:
            sample = self.dataset[i]
            self.model.zero_grad(set_to_none=True)
            batch = one_sample_batch(sample)
            labels = batch.pop("labels")
            logits = self.model(**batch).logits[0]
            torch.nn.functional.cross_entropy(
                logits[:-1], labels[0, 1:], ignore_index=-100, reduction="sum"
            ).backward()
            self._cache[i] = flat_grad(self.model), loss_tokens(sample)
            self.model.zero_grad(set_to_none=True)
        return self._cache[i]


def window_ids(ranks: list[dict[str, Any]], name: str, w: int) -> list[int]:
    return [i for r in ranks for ids in r[name]["windows"][w]["ids"] for i in ids]


def per_micro_step_mean(ref: Reference, ranks: list[dict[str, Any]], name: str, w: int) -> Any:
    """Each micro-step normalised by its own global tokens, then `/ G`."""
    steps = ranks[0][name]["windows"][w]["ids"]
    total = 0
    for t in range(len(steps)):
        g, n = ref.summed([i for r in ranks for i in r[name]["windows"][w]["ids"][t]])
        total = total + g / n / len(steps)
    return total


def rank_means(ref: Reference, ranks: list[dict[str, Any]], name: str, w: int) -> Any:
    """Each rank's own per-token mean, averaged by DDP (a rank that pads adds 0)."""
    total = 0
    for r in ranks:
        ids = [i for step in r[name]["windows"][w]["ids"] for i in step]
        if ids:
            g, n = ref.summed(ids)
            total = total + g / n / WORLD
    return total


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_window_matches_the_single_process_mean(
    ranks: list[dict[str, Any]], name: str
) -> None:
    sc = SCENARIOS[name]
    runs = [r[name] for r in ranks]
    ref = VLMReference(model_for(name), dataset(name))
    windows = runs[0]["windows"]
    assert [len(w["ids"]) for w in windows[:-1]] == [sc["accum"]] * (len(windows) - 1)
    assert len(windows) == len(runs[1]["windows"])
    seen = [i for w in range(len(windows)) for i in window_ids(ranks, name, w)]
    assert sorted(seen) == list(range(sc["data"]["n"])), "every sample exactly once"
    assert all(r["find_unused"] is True for r in runs), "set for a model with a vision tower"
    worst = 0.0
    for w in range(len(windows)):
        want = ref.mean(window_ids(ranks, name, w))
        for r in runs:
            worst = max(worst, rel_l2(r["windows"][w]["grad"], want))
    wrong_rule = per_micro_step_mean if sc["accum"] > 1 else rank_means
    wrong = max(
        rel_l2(wrong_rule(ref, ranks, name, w), ref.mean(window_ids(ranks, name, w)))
        for w in range(len(windows))
    )
    print(
        f"\n[{name}] {len(windows)} windows: worst rel L2 {worst:.2g}; {wrong_rule.__name__} "
        f"{wrong:.2g}"
    )
    assert worst <= TOL < WRONG < wrong


@pytest.mark.parametrize("name", ["lora_packed_g2", "lora_padded_g1"])
def test_lora_trains_the_adapters_only(ranks: list[dict[str, Any]], name: str) -> None:
    model = model_for(name)
    adapter = torch.cat(
        [torch.full((p.numel(),), "lora_" in n) for n, p in model.named_parameters()]
    )
    vision = torch.cat(
        [torch.full((p.numel(),), ".visual." in n) for n, p in model.named_parameters()]
    )
    for w in ranks[0][name]["windows"]:
        grad = w["grad"]
        assert (grad[~adapter] == 0).all()
        assert (grad[adapter] != 0).any()
    assert vision.any() and not (adapter & vision).any()


def test_the_scenarios_hold_what_they_claim(ranks: list[dict[str, Any]]) -> None:
    """What the checks above rest on: G=2 ends on a short window, a rank pads a step,
    and some rank-steps are text-only while others carry images."""
    text_only = {}
    for name in SCENARIOS:
        windows = ranks[0][name]["windows"]
        if SCENARIOS[name]["accum"] == 2:
            assert [len(w["ids"]) for w in windows] == [2] * (len(windows) - 1) + [1]
        images = dataset(name).images
        steps = [ids for r in ranks for w in r[name]["windows"] for ids in w["ids"] if ids]
        text_only[name] = any(all(not images[i] for i in ids) for ids in steps)
        assert any(images[i] for ids in steps for i in ids), f"{name}: no image"
    assert text_only["padded_g1"] and text_only["lora_padded_g1"], text_only
    for name in ("packed_g2", "lora_packed_g2"):
        assert any(p for r in ranks for w in r[name]["windows"] for p in w["pads"]), name
