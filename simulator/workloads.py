"""Seeded synthetic workloads: per-sample observed lengths, cached lengths, preprocessing time.

Each built-in workload approximates the length statistics of a public dataset
(see docs/SIMULATOR.md for the sources and the shape of each distribution). A
workload is a column store of numpy arrays so that 100k-sample epochs cost
nothing to build.

`text`, `visual`, `patches`: what the batcher observes after preprocessing.
`cached`: the length an offline length cache holds (pre-augmentation); it equals
the observed length unless `length_noise` > 0.
`prep_s`: seconds one DataLoader worker spends preprocessing the sample.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from odb_core.errors import ConfigError

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Preprocessing cost per sample (one DataLoader worker, one CPU core); sources in
# docs/SIMULATOR.md. Fixed cost covers chat templating, collation and IPC.
PREP_FIXED_S = 0.5e-3
PREP_PER_TEXT_TOKEN_S = 1.0e-6
PREP_PER_VISUAL_TOKEN_S = 10.0e-6
PREP_PER_VIDEO_TOKEN_S = 40.0e-6
# Qwen2/3-VL merge 2x2 ViT patches into one visual token.
PATCHES_PER_VISUAL_TOKEN = 4


@dataclass(frozen=True)
class Workload:
    name: str
    text: IntArray
    visual: IntArray
    patches: IntArray
    cached: IntArray
    prep_s: FloatArray
    description: str = ""

    def __post_init__(self) -> None:
        n = len(self.text)
        for field in ("visual", "patches", "cached", "prep_s"):
            if len(getattr(self, field)) != n:
                raise ConfigError(f"workload {self.name!r}: column {field} has the wrong length")

    @property
    def n(self) -> int:
        return len(self.text)

    @property
    def length(self) -> IntArray:
        out: IntArray = self.text + self.visual
        return out

    def stats(self) -> dict[str, float]:
        ln = self.length.astype(np.float64)
        if ln.size == 0:
            return {"samples": 0}
        mean = float(ln.mean())
        return {
            "samples": int(ln.size),
            "mean_tokens": round(mean, 1),
            "cv": round(float(ln.std() / mean) if mean else 0.0, 3),
            "p50_tokens": float(np.percentile(ln, 50)),
            "p99_tokens": float(np.percentile(ln, 99)),
            "min_tokens": int(ln.min()),
            "max_tokens": int(ln.max()),
            "visual_fraction": round(float(self.visual.sum() / max(1, ln.sum())), 3),
        }


def _lognormal_mu_for_clipped_mean(mean: float, sigma: float, cap: float) -> float:
    """mu such that E[min(X, cap)] = mean for X ~ LogNormal(mu, sigma), by bisection."""

    def clipped_mean(mu: float) -> float:
        z = (math.log(cap) - mu) / sigma
        phi = 0.5 * (1 + math.erf((z - sigma) / math.sqrt(2)))
        tail = 1 - 0.5 * (1 + math.erf(z / math.sqrt(2)))
        return math.exp(mu + sigma * sigma / 2) * phi + cap * tail

    lo, hi = 0.0, math.log(cap) + 5
    for _ in range(80):
        mid = (lo + hi) / 2
        if clipped_mean(mid) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _prep_time(text: IntArray, visual: IntArray, video: npt.NDArray[np.bool_]) -> FloatArray:
    per_visual = np.where(video, PREP_PER_VIDEO_TOKEN_S, PREP_PER_VISUAL_TOKEN_S)
    out: FloatArray = PREP_FIXED_S + PREP_PER_TEXT_TOKEN_S * text + per_visual * visual
    return out


def _ultrachat(rng: np.random.Generator, n: int) -> tuple[IntArray, IntArray, FloatArray]:
    # Multi-turn text; log-normal body with a long right tail, truncated at 4,096.
    sigma = 0.75
    mu = _lognormal_mu_for_clipped_mean(1470.0, sigma, 4096.0)
    text = np.minimum(np.rint(rng.lognormal(mu, sigma, n)), 4096).astype(np.int64)
    text = np.maximum(text, 16)
    visual = np.zeros(n, dtype=np.int64)
    return text, visual, _prep_time(text, visual, np.zeros(n, dtype=bool))


def _llava(rng: np.random.Generator, n: int) -> tuple[IntArray, IntArray, FloatArray]:
    # LLaVA-1.5: CLIP ViT-L/14 at 336 px -> 24x24 = 576 visual tokens per image;
    # ~5% text-only conversations; 50-600 text tokens (instruction + answer).
    has_image = rng.random(n) < 0.95
    visual = np.where(has_image, 576, 0).astype(np.int64)
    text = rng.integers(50, 601, n).astype(np.int64)
    return text, visual, _prep_time(text, visual, np.zeros(n, dtype=bool))


def _sharegpt4o(rng: np.random.Generator, n: int) -> tuple[IntArray, IntArray, FloatArray]:
    # Images at dynamic resolution: 256-2,500 visual tokens (log-uniform); long
    # captions (log-normal, median ~350 tokens, capped at 2,048); 3% videos whose
    # total length is uniform in 4k-16k tokens.
    video = rng.random(n) < 0.03
    img_visual = np.exp(rng.uniform(math.log(256), math.log(2500), n))
    caption = np.minimum(rng.lognormal(math.log(350), 0.5, n), 2048)
    vid_total = rng.uniform(4000, 16000, n)
    vid_text = rng.uniform(100, 400, n)
    text = np.rint(np.where(video, vid_text, caption)).astype(np.int64)
    visual = np.rint(np.where(video, vid_total - vid_text, img_visual)).astype(np.int64)
    return text, visual, _prep_time(text, visual, video)


def _mmmix(rng: np.random.Generator, n: int) -> tuple[IntArray, IntArray, FloatArray]:
    # Bimodal: 60% short OCR/VQA (100-400 total), 40% captions or multi-image
    # (1,500-6,000 total); most of each length is visual.
    short = rng.random(n) < 0.6
    total = np.where(short, rng.uniform(100, 400, n), rng.uniform(1500, 6000, n))
    text_frac = np.where(short, rng.uniform(0.2, 0.5, n), rng.uniform(0.1, 0.3, n))
    text = np.maximum(np.rint(total * text_frac), 1).astype(np.int64)
    visual = np.rint(total).astype(np.int64) - text
    return text, visual, _prep_time(text, visual, np.zeros(n, dtype=bool))


Generator = Callable[[np.random.Generator, int], tuple[IntArray, IntArray, FloatArray]]

BUILTIN: dict[str, tuple[Generator, float, str]] = {
    # name: (generator, default augmentation noise on the cached length, description)
    "ultrachat": (_ultrachat, 0.0, "multi-turn text, mean ~1,470 tokens, long tail, cut at 4,096"),
    "llava": (_llava, 0.0, "576 visual tokens (95% of samples) + 50-600 text tokens; low CV"),
    "sharegpt4o": (
        _sharegpt4o,
        0.10,
        "dynamic-resolution images (256-2,500 visual), long captions, 3% videos 4k-16k; high CV",
    ),
    "mmmix": (_mmmix, 0.10, "bimodal: 60% OCR/VQA 100-400, 40% captions/multi-image 1.5k-6k"),
}


def default_noise(name: str) -> float:
    return BUILTIN[name][1] if name in BUILTIN else 0.0


def _cached_lengths(
    rng: np.random.Generator, length: IntArray, noise: float, explicit: IntArray | None = None
) -> IntArray:
    if explicit is not None:
        return explicit
    if noise <= 0:
        same: IntArray = length.copy()
        return same
    factor = np.clip(1 + rng.normal(0.0, noise, len(length)), 0.25, None)
    out: IntArray = np.maximum(np.rint(length * factor), 1).astype(np.int64)
    return out


def make_workload(name: str, n: int, seed: int = 0, length_noise: float | None = None) -> Workload:
    """A seeded synthetic workload by name, or a JSONL file path (`*.jsonl`)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"samples={n!r} must be an integer >= 1")
    if length_noise is not None and (not math.isfinite(length_noise) or length_noise < 0):
        raise ConfigError(f"length noise {length_noise!r} must be a finite number >= 0")
    rng = np.random.default_rng([seed, 0x0DB])
    if name in BUILTIN:
        gen, noise, desc = BUILTIN[name]
        text, visual, prep = gen(rng, n)
        noise = noise if length_noise is None else length_noise
        cached = _cached_lengths(rng, text + visual, noise)
        return Workload(name, text, visual, visual * PATCHES_PER_VISUAL_TOKEN, cached, prep, desc)
    if name.endswith(".jsonl") or Path(name).is_file():
        return load_jsonl(Path(name), n, seed, length_noise or 0.0)
    known = ", ".join(sorted(BUILTIN))
    raise ConfigError(f"unknown workload {name!r}; expected one of {known} or a FILE.jsonl")


def load_jsonl(path: Path, n: int | None = None, seed: int = 0, noise: float = 0.0) -> Workload:
    """One sample per line: {"length": int} or {"tokens": int, "visual_tokens": int},
    optional "cached_length" (int) and "prep_s" (seconds). A bare integer line is a
    length. `n` (if given) cycles or truncates the file to n samples."""
    if not path.is_file():
        raise ConfigError(f"workload file {str(path)!r} does not exist")
    text: list[int] = []
    visual: list[int] = []
    cached: list[int | None] = []
    prep: list[float | None] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = raw.strip()
            if not line:
                continue
            t, v, c, p = _parse_line(path, lineno, line)
            text.append(t)
            visual.append(v)
            cached.append(c)
            prep.append(p)
    if not text:
        raise ConfigError(f"{path}: no samples (empty file)")
    count = len(text) if n is None else n
    idx = np.arange(count) % len(text)
    t_arr = np.asarray(text, dtype=np.int64)[idx]
    v_arr = np.asarray(visual, dtype=np.int64)[idx]
    rng = np.random.default_rng([seed, 0x0DB])
    if all(x is not None for x in cached):
        explicit: IntArray | None = np.asarray(cached, dtype=np.int64)[idx]
    else:
        explicit = None
    cached_arr = _cached_lengths(rng, t_arr + v_arr, noise, explicit)
    default_prep = _prep_time(t_arr, v_arr, np.zeros(count, dtype=bool))
    prep_arr = np.asarray([np.nan if x is None else x for x in prep], dtype=np.float64)[idx]
    prep_arr = np.where(np.isnan(prep_arr), default_prep, prep_arr)
    return Workload(
        str(path),
        t_arr,
        v_arr,
        v_arr * PATCHES_PER_VISUAL_TOKEN,
        cached_arr,
        prep_arr,
        f"observed lengths from {path.name} ({len(text)} lines)",
    )


def _nonneg_int(path: Path, lineno: int, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}:{lineno}: {key}={value!r} is not a number")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ConfigError(f"{path}:{lineno}: {key}={value!r} is not an integer token count")
    if value < 0:
        raise ConfigError(f"{path}:{lineno}: {key}={value!r} is negative")
    return int(value)


def _parse_line(path: Path, lineno: int, line: str) -> tuple[int, int, int | None, float | None]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}:{lineno}: malformed JSON line {line[:80]!r} ({exc.msg})"
        ) from None
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        obj = {"length": obj}
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}:{lineno}: expected an object or a length, got {line[:80]!r}")
    if "length" in obj:
        text = _nonneg_int(path, lineno, "length", obj["length"])
        visual = 0
    elif "tokens" in obj:
        text = _nonneg_int(path, lineno, "tokens", obj["tokens"])
        visual = _nonneg_int(path, lineno, "visual_tokens", obj.get("visual_tokens", 0))
    else:
        raise ConfigError(f"{path}:{lineno}: line has neither 'length' nor 'tokens': {line[:80]!r}")
    if text + visual < 1:
        raise ConfigError(f"{path}:{lineno}: sample length must be >= 1, got {text + visual}")
    cached = obj.get("cached_length")
    c = None if cached is None else max(1, _nonneg_int(path, lineno, "cached_length", cached))
    prep = obj.get("prep_s")
    p: float | None = None
    if prep is not None:
        if (
            isinstance(prep, bool)
            or not isinstance(prep, (int, float))
            or not (math.isfinite(prep) and prep >= 0)
        ):
            raise ConfigError(f"{path}:{lineno}: prep_s={prep!r} must be a finite number >= 0")
        p = float(prep)
    return text, visual, c, p
