"""`odb_core.torch.vlm` on one process: what a packed multimodal row holds, the
samples it refuses, and that it runs in DataLoader workers."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vlm_fixtures import IMAGE_TOKEN, tiny_qwen3_vl, vlm_sample  # noqa: E402

from odb_core.torch.collate import pack_collate, packed_segments  # noqa: E402
from odb_core.torch.vlm import MRopeIndex, VLMPackCollate, vlm_pack_collate  # noqa: E402

pytestmark = [pytest.mark.torch]

SAMPLES = [vlm_sample(1, [(4, 6), (2, 2)]), vlm_sample(2, [], text=9), vlm_sample(3, [(6, 4)])]


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_qwen3_vl(seed=0)


def test_packed_row_carries_each_samples_model_positions(model: Any) -> None:
    batch = vlm_pack_collate(SAMPLES, MRopeIndex.from_model(model))
    lengths = [len(s["input_ids"]) for s in SAMPLES]
    assert batch["position_ids"].shape == (4, 1, sum(lengths))
    start = 0
    for s, n in zip(SAMPLES, lengths, strict=True):
        ids = s["input_ids"][None]
        own, _ = model.model.get_rope_index(
            ids,
            mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
            image_grid_thw=s.get("image_grid_thw"),
        )
        assert torch.equal(batch["position_ids"][1:, :, start : start + n], own)
        assert torch.equal(batch["position_ids"][0, 0, start : start + n], torch.arange(n))
        start += n
    images = [s for s in SAMPLES if "pixel_values" in s]
    assert torch.equal(batch["pixel_values"], torch.cat([s["pixel_values"] for s in images]))
    assert torch.equal(batch["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in images]))
    assert batch["use_cache"] is False


def test_flash_attention_varlen_finds_the_samples(model: Any) -> None:
    """transformers' varlen path (GPU) derives cu_seqlens from the position_ids the
    text model passes its attention: row 0, the text positions."""
    from transformers.modeling_flash_attention_utils import (
        _is_packed_sequence,
        prepare_fa_kwargs_from_position_ids,
    )

    pos = vlm_pack_collate(SAMPLES, MRopeIndex.from_model(model))["position_ids"]
    text = pos[0]
    assert _is_packed_sequence(text, 1)
    (cu_q, cu_k), _ = prepare_fa_kwargs_from_position_ids(text)
    bounds = torch.tensor([0, *torch.tensor([len(s["input_ids"]) for s in SAMPLES]).cumsum(0)])
    assert cu_q.tolist() == cu_k.tolist() == bounds.tolist()
    assert [e - s for s, e in packed_segments(text)[0]] == torch.diff(bounds).tolist()
    # The broken variant: the 3 mRoPE rows alone (the text model then has no text
    # row to pass on) flattened into cu_seqlens give 3x the samples.
    (cu_bad, _), _ = prepare_fa_kwargs_from_position_ids(pos[1:])
    assert len(cu_bad) == 3 * len(SAMPLES) + 1


def test_pack_collate_refuses_an_image_sample() -> None:
    with pytest.raises(
        ValueError, match=r"sample 0 has pixel_values, image_grid_thw.*VLMPackCollate"
    ):
        pack_collate(SAMPLES)


def test_a_sample_that_cannot_be_positioned_is_refused(model: Any) -> None:
    rope = MRopeIndex.from_model(model)
    bad = dict(SAMPLES[0])
    bad["image_grid_thw"] = torch.tensor([[1, 4, 6]])  # one image's grid for two images
    bad["pixel_values"] = bad["pixel_values"][:24]
    with pytest.raises(ValueError, match="sample 1 cannot be positioned: 7 image tokens"):
        vlm_pack_collate([SAMPLES[1], bad], rope)
    no_grid = {k: v for k, v in SAMPLES[0].items() if k != "image_grid_thw"}
    with pytest.raises(ValueError, match="pixel_values without image_grid_thw"):
        vlm_pack_collate([no_grid], rope)
    with pytest.raises(ValueError, match="no position_ids and no rope"):
        vlm_pack_collate(SAMPLES, None)


def test_runs_in_dataloader_workers_and_from_preprocessed_positions(model: Any) -> None:
    rope = pickle.loads(pickle.dumps(MRopeIndex.from_model(model)))
    want = vlm_pack_collate(SAMPLES, rope)
    loader = torch.utils.data.DataLoader(
        SAMPLES, batch_size=3, num_workers=1, collate_fn=VLMPackCollate(rope)
    )
    (got,) = list(loader)
    assert torch.equal(got["position_ids"], want["position_ids"])
    # Positions computed in preprocessing (the worker's __getitem__), no rope at collation.
    pre = [{**s, "position_ids": rope(s["input_ids"], s.get("image_grid_thw"))} for s in SAMPLES]
    assert torch.equal(vlm_pack_collate(pre)["position_ids"], want["position_ids"])


def test_check_packed_model_reads_the_text_config(model: Any) -> None:
    """Qwen3-VL keeps use_cache=True in text_config (none at the top): packed rows
    without use_cache=False attend across samples, and the check says so."""
    from odb_core.errors import ConfigError
    from odb_core.torch.collate import check_packed_model

    assert model.config.text_config.use_cache
    with pytest.raises(ConfigError, match="use_cache=True \\(from Qwen3VLTextConfig\\)"):
        check_packed_model(model)
    batch = vlm_pack_collate(SAMPLES, MRopeIndex.from_model(model))
    check_packed_model(model, batch)
    with torch.no_grad():
        right = model(**batch).logits
        batch.pop("use_cache")
        crossing = model(**batch).logits
    assert (right - crossing).abs().max() > 1e-3  # the trap the check guards is real
    model.config.text_config.use_cache = False
    try:
        check_packed_model(model)
    finally:
        model.config.text_config.use_cache = True
