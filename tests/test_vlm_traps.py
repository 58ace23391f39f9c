"""The traps a VLM sample (input_ids with its image tokens already expanded, its
pixel_values beside) met in the loader: visual tokens counted twice by the default
cost, and truncation cutting image tokens apart from their pixels."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from vlm_fixtures import vlm_sample  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.errors import SampleError  # noqa: E402
from odb_core.torch.measure import default_truncate, measure  # noqa: E402

pytestmark = [pytest.mark.torch]


def with_visual_tokens(sample: dict[str, Any]) -> dict[str, Any]:
    grid = sample["image_grid_thw"]
    return {**sample, "visual_tokens": int(grid.prod(-1).sum()) // 4}


IMAGE = with_visual_tokens(vlm_sample(0, [(4, 6), (2, 2)], text=6, answer=5))  # 13 + 7 tokens


def test_visual_tokens_are_counted_once() -> None:
    n = len(IMAGE["input_ids"])
    s = measure(IMAGE, 0, None)
    assert s.tokens + s.visual_tokens == n
    assert (s.tokens, s.visual_tokens) == (n - 7, 7)
    assert measure({k: v for k, v in IMAGE.items() if k != "visual_tokens"}, 0, None).tokens == n


def test_visual_tokens_beyond_input_ids_are_refused() -> None:
    bad = {**IMAGE, "visual_tokens": len(IMAGE["input_ids"]) + 1}
    with pytest.raises(SampleError, match=r"sample 4: visual_tokens=.*pass cost_fn="):
        measure(bad, 4, None)


class Samples(torch.utils.data.Dataset):  # type: ignore[misc]
    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.samples[i]


def loader(samples: list[dict[str, Any]], budget: int, **kw: Any) -> ODBDataLoader:
    return ODBDataLoader(
        Samples(samples),
        collate_fn=lambda b: b,
        cost_model="packed",
        token_budget=budget,
        shuffle=False,
        num_workers=0,
        **kw,
    )


def test_a_sample_that_fits_with_its_visual_tokens_counted_once_is_admitted() -> None:
    n = len(IMAGE["input_ids"])
    batches = list(loader([IMAGE], n))
    assert [len(b["batch"]) for b in batches] == [1]


def test_truncate_refuses_to_cut_image_tokens_from_their_pixels() -> None:
    with pytest.raises(SampleError, match=r"sample 3: oversize='truncate' would cut.*pixel_values"):
        default_truncate(IMAGE, 10, len(IMAGE["input_ids"]) - 7, 3)
    text = vlm_sample(1, [], text=20, answer=10)
    cut = default_truncate(text, 12, 30, 1)
    assert len(cut["input_ids"]) == len(cut["labels"]) == 12


def test_truncate_through_the_loader_names_the_sample() -> None:
    text = vlm_sample(1, [], text=20, answer=10)
    batches = list(loader([text], 16, oversize="truncate"))
    assert len(batches[0]["batch"][0]["input_ids"]) == 16
    with pytest.raises(SampleError, match="sample 0: oversize='truncate' would cut"):
        list(loader([IMAGE, text], 16, oversize="truncate"))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_hf_trainer_finds_unused_parameters_for_a_vision_model(
    tmp_path: Any, checkpointing: bool
) -> None:
    """ODBHFTrainer sets ddp_find_unused_parameters=True for a model with a vision
    tower (text-only batches leave it without gradients; test_vlm_packing shows
    DDP's default failing on 2 ranks); transformers' own default is False under
    activation checkpointing. An explicit value stays."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments
    from vlm_fixtures import tiny_qwen3_vl

    from odb_core.integrations.hf import ODBArguments, ODBHFTrainer

    def trainer(**extra: Any) -> Any:
        args = TrainingArguments(
            output_dir=str(tmp_path),
            use_cpu=True,
            report_to=[],
            activation_checkpointing=checkpointing,
            **extra,
        )
        return ODBHFTrainer(
            model=tiny_qwen3_vl(),
            args=args,
            train_dataset=Samples([IMAGE]),
            odb=ODBArguments(token_budget=64),
        )

    t = trainer()
    assert t.args.ddp_find_unused_parameters is True
    assert t.accelerator.ddp_handler.find_unused_parameters is True
    assert trainer(ddp_find_unused_parameters=False).args.ddp_find_unused_parameters is False
