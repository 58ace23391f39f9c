"""The raw data of `odb bench --model qwen3-vl-tiny`: a seeded synthetic
multimodal mix whose images are stored encoded (PNG / JPEG bytes), as a dataset
on disk holds them. Nothing here knows a sample's token count: that is known only
after the image processor and the tokenizer run (`odb_core.bench.vlm_preprocess`).

The mix is the simulator's `mmmix` (docs/SIMULATOR.md: 60% short OCR/VQA, 40%
captions or multi-image; most of each length visual) scaled to a CPU model
(images up to 512 x 512 px, i.e. 256 visual tokens at Qwen3-VL's 16 px patches
merged 2 x 2, against 2,500 in the reference), plus the text-only share of
LLaVA-665K-style mixes (its ShareGPT text conversations):

| kind      | share | images | image sides (px, log-uniform) | answer words              |
|-----------|-------|--------|-------------------------------|---------------------------|
| `text`    | 10%   | 0      | -                             | log-normal 120, 0.6, <=400 |
| `ocr_vqa` | 50%   | 1      | 48-320 (PNG)                  | uniform 1-12              |
| `caption` | 40%   | 1-3    | 160-720 (JPEG), <= max_pixels | log-normal 60, 0.6, <=300 |

(log-normal: median, sigma, cap.)

Questions are 4-24 words (text-only: 10-40). An image's dominant colour is the
first word of its answer, so the vision tower has something to learn; the rest of
an answer follows a per-sample rule over a fixed word list (as `LongTailText`;
`MixParams.answer_rule` picks the rule's multiplier, so the fine-tuning regime
pretrains on the same images and words under another rule).
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass
from enum import Enum

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (200, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 200),
    "yellow": (220, 200, 40),
    "purple": (130, 50, 160),
    "orange": (230, 130, 30),
    "grey": (128, 128, 128),
    "teal": (30, 150, 150),
}
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "po", "da", "fi", "gu", "he")
WORDS: tuple[str, ...] = tuple(
    a + b + c for a in _SYLLABLES for b in _SYLLABLES[:6] for c in ("", "n", "s")
)


class Kind(Enum):
    TEXT = "text"
    OCR_VQA = "ocr_vqa"
    CAPTION = "caption"


@dataclass(frozen=True)
class MixParams:
    """The distribution's parameters (the table in the module docstring)."""

    text_share: float = 0.10
    ocr_share: float = 0.50  # the rest are captions / multi-image
    ocr_side: tuple[int, int] = (48, 320)
    caption_side: tuple[int, int] = (160, 720)
    caption_images: tuple[int, int] = (1, 3)
    ocr_answer: tuple[int, int] = (1, 12)
    caption_answer_median: float = 60.0
    caption_answer_cap: int = 300
    text_answer_cap: int = 400
    text_answer_median: float = 120.0
    answer_sigma: float = 0.6
    question: tuple[int, int] = (4, 24)
    text_question: tuple[int, int] = (10, 40)
    answer_rule: int = 5
    """The answers' rule multiplier (`_answer`): another value, another
    distribution (the fine-tuning regime pretrains on 3)."""


@dataclass(frozen=True)
class RawSample:
    """One stored sample: its encoded images, their colour words, and its text."""

    kind: Kind
    images: tuple[bytes, ...]
    colours: tuple[str, ...]
    question: str
    answer: str

    @property
    def words(self) -> int:
        """Words of text, the length LLaVA's `modality_lengths` reads (no pass)."""
        return len(self.question.split()) + len(self.answer.split())


def _image(rng: random.Random, side: tuple[int, int], fmt: str) -> tuple[bytes, str]:
    from PIL import Image, ImageDraw

    lo, hi = math.log(side[0]), math.log(side[1])
    w, h = (int(math.exp(rng.uniform(lo, hi))) for _ in range(2))
    colour = rng.choice(sorted(COLOURS))
    img = Image.new("RGB", (w, h), COLOURS[colour])
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randrange(1, 5)):  # small shapes, never the dominant colour
        x, y = rng.randrange(w), rng.randrange(h)
        dx, dy = rng.randrange(1, max(2, w // 4)), rng.randrange(1, max(2, h // 4))
        fill = tuple(rng.randrange(256) for _ in range(3))
        draw.rectangle((x, y, x + dx, y + dy), fill=fill)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    return buf.getvalue(), colour


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def _answer(rng: random.Random, n: int, rule: int) -> list[str]:
    """A word sequence following a per-sample rule (learnable from its start)."""
    step = 1 + rng.randrange(7)
    at = rng.randrange(len(WORDS))
    out = []
    for _ in range(n):
        out.append(WORDS[at])
        at = (at * rule + step) % len(WORDS)
    return out


def _lognormal_words(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))


def raw_sample(seed: int, i: int, p: MixParams) -> RawSample:
    """Sample `i` of the seeded mix (the same bytes for the same seed and i)."""
    rng = random.Random(seed * 1_000_003 + i)
    u = rng.random()
    if u < p.text_share:
        kind, images, side, n_answer = (
            Kind.TEXT,
            0,
            (0, 0),
            _lognormal_words(rng, p.text_answer_median, p.answer_sigma, p.text_answer_cap),
        )
        q = rng.randint(*p.text_question)
    elif u < p.text_share + p.ocr_share:
        kind, images, side, n_answer = Kind.OCR_VQA, 1, p.ocr_side, rng.randint(*p.ocr_answer)
        q = rng.randint(*p.question)
    else:
        kind, images, side = Kind.CAPTION, rng.randint(*p.caption_images), p.caption_side
        n_answer = _lognormal_words(
            rng, p.caption_answer_median, p.answer_sigma, p.caption_answer_cap
        )
        q = rng.randint(*p.question)
    fmt = "PNG" if kind is Kind.OCR_VQA else "JPEG"
    encoded = [_image(rng, side, fmt) for _ in range(images)]
    colours = tuple(c for _, c in encoded)
    answer = [*colours, *_answer(rng, n_answer, p.answer_rule)]
    return RawSample(
        kind,
        tuple(b for b, _ in encoded),
        colours,
        " ".join(_words(rng, q)),
        " ".join(answer),
    )


def corpus(seed: int, n: int = 400) -> list[str]:
    """Text to train the bench's tokenizer on (the same word list and rules)."""
    rng = random.Random(seed)
    out = [" ".join(_words(rng, 20)) for _ in range(n)]
    out += [" ".join(_answer(rng, 40, MixParams.answer_rule)) for _ in range(n)]
    out += [" ".join(sorted(COLOURS))] * 10
    return out
