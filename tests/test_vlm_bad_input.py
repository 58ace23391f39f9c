"""Bad input on the VLM bench's own data (issue 30), through `ODBDataLoader` with the
real Qwen-VL image processor running in a DataLoader worker: an image that does not
decode reaches the loader's sample-error path naming the sample, and a sample whose
visual tokens alone exceed the budget gets each documented oversize policy."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from odb_core import ODBDataLoader
from odb_core.bench.vlm_data import Kind, RawSample
from odb_core.bench.vlm_preprocess import VLMSFT
from odb_core.errors import OversizeSampleError, SampleError
from odb_core.torch import SampleLoadError

pytestmark = [pytest.mark.torch]

BUDGET = 640
BIG = 3  # the sample re-stored with three 512 x 512 images: 3 x 256 visual tokens


def _png(side: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (30, 90, 200)).save(buf, format="PNG")
    return buf.getvalue()


def _mix(n: int = 6) -> VLMSFT:
    ds = VLMSFT(n, 4096, 0)  # max_len far above the budget: the loader, not the
    # dataset, meets the oversize sample
    ds.raw[BIG] = RawSample(
        Kind.CAPTION, (_png(512),) * 3, ("blue",) * 3, "describe these", "three blue squares"
    )
    return ds


def _loader(ds: VLMSFT, **kw: Any) -> ODBDataLoader:
    return ODBDataLoader(
        ds,
        collate_fn=lambda b: b,
        cost_model="packed",
        token_budget=BUDGET,
        shuffle=False,
        num_workers=1,  # the image processor runs in a worker, as in training
        **kw,
    )


def _tokens(ds: VLMSFT) -> dict[int, int]:
    return {i: len(ds[i]["input_ids"]) for i in range(len(ds))}


def test_the_mix_has_one_sample_over_the_budget() -> None:
    tokens = _tokens(_mix())
    assert tokens[BIG] > 3 * 256 > BUDGET
    assert all(n <= BUDGET for i, n in tokens.items() if i != BIG), tokens


def _drain(loader: ODBDataLoader) -> list[list[int]]:
    """Every step's sample ids, by iteration alone (`list(loader)` would first ask
    `len()`, whose step estimate reads samples in this process)."""
    return [[s["idx"] for s in step["batch"]] for step in iter(loader)]


def test_an_image_that_does_not_decode_names_its_sample_through_the_loader() -> None:
    ds = _mix()
    ds.raw[2] = dataclasses.replace(ds.raw[2], images=(b"not an image",), colours=("red",))
    for read in (_drain, len):  # in the worker; in this process, for the step estimate
        with pytest.raises(SampleLoadError) as info:
            read(_loader(ds, oversize="solo"))
        assert info.value.sample_id == 2
        assert info.value.error_type == "SampleDecodeError"
        assert "sample 2: an image does not decode" in str(info.value)


@pytest.mark.parametrize(
    ("read", "where"), [(_drain, "rank 0"), (len, "the step estimate")], ids=["iter", "len"]
)
def test_oversize_error_names_the_sample(read: Any, where: str) -> None:
    with pytest.raises(OversizeSampleError, match=rf"{where}: sample {BIG} costs \d+ .*over"):
        read(_loader(_mix()))


def test_oversize_solo_runs_the_sample_alone_and_keeps_every_id_once() -> None:
    ds = _mix()
    batches = _drain(_loader(ds, oversize="solo"))
    assert [BIG] in batches  # alone, its images and tokens whole
    assert sorted(i for b in batches for i in b) == list(range(len(ds)))
    tokens = _tokens(ds)
    assert all(sum(tokens[i] for i in b) <= BUDGET for b in batches if b != [BIG])


def test_oversize_truncate_refuses_to_cut_image_tokens_from_their_pixels() -> None:
    with pytest.raises(SampleError, match=rf"sample {BIG}: oversize='truncate' would cut"):
        _drain(_loader(_mix(), oversize="truncate"))
