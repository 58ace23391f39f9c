"""The simulator's workload for `odb bench --model qwen3-vl-tiny`: the bench's own
seeded mix, each sample's text and visual tokens counted by running the bench's
preprocessing on it (`odb_core.bench.vlm_preprocess.VLMSFT.__getitem__`: image
decode, the Qwen-VL image processor, the chat template, the tokenizer), so the
counts are exact, not drawn from a distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from simulator.cpu_profile import PrepModel
from simulator.workloads import PATCHES_PER_VISUAL_TOKEN, FloatArray, IntArray, Workload


@dataclass(frozen=True)
class BenchSamples:
    """Per sample of the bench's data set: tokens after preprocessing, and the
    seconds its preprocessing took here (one run, this process)."""

    seed: int
    text: IntArray
    visual: IntArray
    prep_s: FloatArray

    @property
    def n(self) -> int:
        return len(self.text)


def count_bench_samples(samples: int, seed: int, max_len: int) -> BenchSamples:
    """Run the bench's preprocessing over its seeded mix (needs the `vlm` extra)."""
    from odb_core.bench.vlm_preprocess import VLMSFT, visual_tokens

    ds = VLMSFT(samples, max_len, seed)
    ds[0]  # build the tokenizer and image processor outside the timed loop
    text, visual, prep = [], [], []
    for i in range(len(ds)):
        t0 = time.perf_counter()
        s = ds[i]
        prep.append(time.perf_counter() - t0)
        vis = sum(visual_tokens(s["image_grid_thw"])) if "image_grid_thw" in s else 0
        visual.append(vis)
        text.append(len(s["input_ids"]) - vis)
    return BenchSamples(
        seed,
        np.asarray(text, dtype=np.int64),
        np.asarray(visual, dtype=np.int64),
        np.asarray(prep, dtype=np.float64),
    )


def bench_workload(counts: BenchSamples, prep: PrepModel) -> Workload:
    """The simulator's workload: exact lengths (the bench's length pass reads the
    same, so `cached` equals them) and the fitted preprocessing time per sample
    in a DataLoader worker."""
    length = counts.text + counts.visual
    prep_s: FloatArray = prep.sample_s + prep.visual_token_s * counts.visual.astype(np.float64)
    return Workload(
        f"qwen3-vl-tiny bench mix (seed {counts.seed})",
        counts.text,
        counts.visual,
        counts.visual * PATCHES_PER_VISUAL_TOKEN,
        length.copy(),
        prep_s,
        "odb bench --model qwen3-vl-tiny's data, counted by its own preprocessing",
    )
