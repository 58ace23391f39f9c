"""Packing a multimodal-RoPE model (transformers' own Qwen3-VL, tiny, float64) is
exact: on 2 real gloo ranks through `ODBDataLoader` with `VLMPackCollate`, every
step's DDP gradient (loss scaled by the step meta) equals the single-process
per-token mean over the same samples run one at a time, and each sample's loss
read from the packed row equals its loss alone, with and without images, on
SDPA with the packed mask and on `use_packed_attention`, full fine-tuning and
under PEFT LoRA (`images_varlen_lora`; ODBHFTrainer's path: test_vlm_trainer.py).

The broken variant, 1-D positions restarting at 0 per sample (what
`pack_collate` gives a text sample), runs in the same launch and misses the
reference by more than 1e-2 on the image samples: the comparison can fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vlm_fixtures import VLMSet, one_sample_batch, tiny_qwen3_vl, with_lora  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.procs, pytest.mark.slow]

WORLD = 2
TOL = 1e-6
WRONG = 1e-2

#: (grid h, grid w) in patches per image; [] is a text-only sample.
IMAGES: list[list[tuple[int, int]]] = [
    [(4, 6)],
    [],
    [(2, 2), (4, 4)],
    [(6, 4)],
    [],
    [(2, 6)],
    [],
    [(4, 2), (2, 2)],
    [(8, 4)],
    [],
    [(2, 4)],
    [],
]
TEXT_ONLY = [[] for _ in range(8)]


class OneDPositions:
    """The broken variant: the packed row with 1-D positions restarting at 0."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, samples: Any) -> dict[str, Any]:
        out: dict[str, Any] = self.collate(samples)
        out["position_ids"] = out["position_ids"][0]
        return out


#: One sample per step: both ranks text-only first (longer: the former takes the
#: longest first), then both with images.
TEXT_THEN_IMAGES: list[list[tuple[int, int]]] = [[], [], [(4, 4)], [(2, 4)]]
ONE_PER_STEP = {"max_samples": 1, "shuffle": False}

CASES: dict[str, dict[str, Any]] = {
    "images_sdpa": {"images": IMAGES, "varlen": False},
    "images_varlen": {"images": IMAGES},
    "images_varlen_lora": {"images": IMAGES, "lora": True},
    "text_only": {"images": TEXT_ONLY},
    "images_1d_positions": {"images": IMAGES, "broken": True},
    "text_then_images": {"images": TEXT_THEN_IMAGES, "loader": ONE_PER_STEP, "text_extra": 30},
    # Last: DDP's default fails, and the ranks stop there.
    "text_then_images_ddp_default": {
        "images": TEXT_THEN_IMAGES,
        "loader": ONE_PER_STEP,
        "text_extra": 30,
        "find_unused": False,
    },
}


def token_ce_sums(
    logits: torch.Tensor, labels: torch.Tensor, segments: list[tuple[int, int]]
) -> list[float]:
    ce = torch.nn.functional.cross_entropy
    return [
        float(ce(logits[0, s : e - 1], labels[0, s + 1 : e], ignore_index=-100, reduction="sum"))
        for s, e in segments
    ]


def run_cases(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Inside a rank: each case's per-step ids, per-sample packed losses, gradients."""
    from torch.nn.parallel import DistributedDataParallel

    from odb_core import ODBDataLoader
    from odb_core.torch.collate import use_packed_attention
    from odb_core.torch.vlm import MRopeIndex, VLMPackCollate

    out: dict[str, Any] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    for name, case in CASES.items():
        model = tiny_qwen3_vl(seed=0)
        if case.get("varlen", True):
            use_packed_attention(model)
        rope = MRopeIndex.from_model(model)
        if case.get("lora"):
            model = with_lora(model)
        # A text-only batch leaves the vision tower out of the graph.
        ddp = DistributedDataParallel(model, find_unused_parameters=case.get("find_unused", True))
        collate: Any = VLMPackCollate(rope)
        if case.get("broken"):
            collate = OneDPositions(collate)
        options = {
            "cost_model": "packed",
            "token_budget": 96,
            "shuffle": True,
            "seed": 3,
            "deterministic": True,
            "buffer_size": 8,
            "max_steps_per_round": 4,
            "num_workers": 0,
            **case.get("loader", {}),
        }
        loader = ODBDataLoader(
            VLMSet(case["images"], case.get("text_extra", 0)), collate_fn=collate, **options
        )
        loader.set_epoch(0)
        steps, grads[name] = [], []
        try:
            run_epoch(loader, ddp, model, steps, grads[name])
        except RuntimeError as exc:
            if case.get("find_unused", True):
                raise
            out[name] = {"error": str(exc)}
            break
        out[name] = steps
    torch.save(grads, Path(spec["out"], f"grads{rank}.pt"))
    return out


def run_epoch(loader: Any, ddp: Any, model: Any, steps: list[Any], grads: list[Any]) -> None:
    from odb_core.torch import causal_lm_loss, pop_step_meta
    from odb_core.torch.collate import packed_segments

    for batch in loader:
        meta = pop_step_meta(batch)
        ids = [int(i) for i in loader.step_info.sample_ids]  # type: ignore[union-attr]
        labels = batch.pop("labels")
        ddp.zero_grad(set_to_none=True)
        logits = ddp(**batch).logits
        causal_lm_loss(meta, logits, labels).backward()
        text_pos = batch["position_ids"]
        text_pos = text_pos[0] if text_pos.dim() == 3 else text_pos
        segs = packed_segments(text_pos)[0] if ids else []
        steps.append(
            {
                "ids": ids,
                "lengths": [e - s for s, e in segs],
                "losses": token_ce_sums(logits.detach(), labels, segs),
            }
        )
        grads.append(
            torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in model.parameters()
                ]
            )
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from gloo_ranks import launch, ok

    out = tmp_path_factory.mktemp("vlm")
    per_rank = ok(launch("test_vlm_packing:run_cases", WORLD, {"out": str(out)}, out))
    grads = [torch.load(out / f"grads{r}.pt") for r in range(WORLD)]
    return {"steps": per_rank, "grads": grads}


def reference(model: Any, dataset: VLMSet, ids: list[int]) -> tuple[torch.Tensor, list[float]]:
    """One sample at a time, positioned by the model itself (no position_ids: it
    runs its own get_rope_index): the gradient of the per-token mean over `ids`, and
    each sample's summed token cross-entropy."""
    model.zero_grad(set_to_none=True)
    tokens = sum(int((dataset[i]["labels"][1:] != -100).sum()) for i in ids)
    losses = []
    for i in ids:
        sample = dataset[i]
        batch = one_sample_batch(sample)
        labels = batch.pop("labels")
        logits = model(**batch).logits
        n = labels.shape[1]
        loss = torch.nn.functional.cross_entropy(
            logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum"
        )
        losses.append(float(loss.detach()))
        (loss / tokens).backward()
        assert n == len(sample["input_ids"])
    grad = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in model.parameters()
        ]
    )
    return grad, losses


def errors(runs: dict[str, Any], name: str) -> tuple[float, float]:
    """Worst relative gradient error and worst relative per-sample loss error."""
    model = tiny_qwen3_vl(seed=0)
    if CASES[name].get("lora"):
        model = with_lora(model)
    dataset = VLMSet(CASES[name]["images"], CASES[name].get("text_extra", 0))
    steps = [r[name] for r in runs["steps"]]
    grad_err = loss_err = 0.0
    seen: list[int] = []
    for t in range(len(steps[0])):
        ids = [i for r in range(WORLD) for i in steps[r][t]["ids"]]
        seen += ids
        want, losses = reference(model, dataset, ids)
        for r in range(WORLD):
            got = runs["grads"][r][name][t]
            grad_err = max(grad_err, float((got - want).norm() / want.norm()))
        packed = [x for r in range(WORLD) for x in steps[r][t]["losses"]]
        lengths = [x for r in range(WORLD) for x in steps[r][t]["lengths"]]
        assert lengths == [len(dataset[i]["input_ids"]) for i in ids]
        for a, b in zip(packed, losses, strict=True):
            loss_err = max(loss_err, abs(a - b) / abs(b))
    assert sorted(seen) == list(range(len(dataset)))
    return grad_err, loss_err


@pytest.mark.parametrize(
    "name", ["images_sdpa", "images_varlen", "images_varlen_lora", "text_only"]
)
def test_packed_vlm_equals_one_sample_at_a_time(runs: dict[str, Any], name: str) -> None:
    grad_err, loss_err = errors(runs, name)
    print(f"\n{name}: gradient {grad_err:.1e}, per-sample loss {loss_err:.1e}")
    assert grad_err <= TOL
    assert loss_err <= TOL


def test_one_d_positions_are_caught(runs: dict[str, Any]) -> None:
    grad_err, loss_err = errors(runs, "images_1d_positions")
    print(f"\n1-D positions: gradient {grad_err:.1e}, per-sample loss {loss_err:.1e}")
    assert grad_err > WRONG


def test_text_only_steps_then_images_under_ddp(runs: dict[str, Any]) -> None:
    """With find_unused_parameters=True (what docs/ADAPTERS.md says to set, and what
    ODBHFTrainer sets for a model with a vision tower) a text-only step before an
    image step trains exactly; DDP's default fails on the image step."""
    steps = [r["text_then_images"] for r in runs["steps"]]
    first = [i for r in range(WORLD) for i in steps[r][0]["ids"]]
    assert all(not TEXT_THEN_IMAGES[i] for i in first), "the first step must be text-only"
    grad_err, loss_err = errors(runs, "text_then_images")
    print(f"\ntext then images: gradient {grad_err:.1e}, per-sample loss {loss_err:.1e}")
    assert grad_err <= TOL and loss_err <= TOL
    for r in runs["steps"]:
        assert "Expected to have finished reduction" in r["text_then_images_ddp_default"]["error"]
