"""What `odb bench --model` accepts: its models and strategies, their defaults and
groupings (offline plans, packed plans, the odb-core recipes), the `--quality`
schedule's warm-up, and the validation of a run's params (pure, before any rank
starts); the workload of a model."""

from __future__ import annotations

import importlib
import importlib.util
import math
from typing import Any

from odb_core.bench.recipes import RECIPES
from odb_core.bench.workload import MIN_LEN, SIZES, TextWorkload

VLM_MODELS = ("qwen3-vl-tiny",)  # odb_core.bench.vlm_workload.VLM_SIZES (imported lazily)

STRATEGIES = (
    "standard",
    "grouped",
    "grouped-estimate",
    "gmt",
    "trl-packed",
    "odb-padded",
    "odb-packed",
    "odb-max-samples",
    "odb-max-samples-packed",
    "odb-sqrt-lr",
    "odb-linear-lr",
    "odb-parity",
    "odb-ref",
)
ODB_STRATEGIES = tuple(RECIPES)
THROUGHPUT_DEFAULT = ("standard", "grouped", "gmt", "odb-padded", "odb-packed", "odb-ref")
VLM_DEFAULT = ("standard", "grouped", "grouped-estimate", "gmt", "odb-padded", "odb-packed")
VLM_QUALITY_DEFAULT = (*VLM_DEFAULT, "odb-max-samples", "odb-linear-lr")
PLANNED = ("gmt", "grouped", "grouped-estimate", "trl-packed")  # offline plans (_Batches)
PACKED_PLANS = ("trl-packed",)
QUALITY_DEFAULT = tuple(
    s for s in STRATEGIES if s not in ("odb-ref", "grouped-estimate", "trl-packed")
)
REGIMES = ("scratch", "finetune")
WARMUP = 0.05  # of the run, every --quality schedule (linear to 0 at the last update)


def odb_ref_missing() -> str | None:
    """None if the comparator `online-dynamic-batching` is importable, else why not."""
    try:
        importlib.import_module("odb")
    except Exception as exc:
        return f"online-dynamic-batching not importable ({type(exc).__name__}: {exc})"
    return None


def validate(params: dict[str, Any]) -> list[str]:
    """Raise ValueError naming a bad option; returns the strategies to run."""
    vlm = params["model"] in VLM_MODELS
    if params["model"] not in SIZES and not vlm:
        known = ", ".join([*SIZES, *VLM_MODELS])
        raise ValueError(f"unknown --model {params['model']!r}; expected one of {known}")
    if vlm:
        _validate_vlm(params)
    elif params.get("lora"):
        raise ValueError(
            f"--lora is for a VLM --model ({', '.join(VLM_MODELS)}); --model "
            f"{params['model']} trains full"
        )
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("--model needs transformers: pip install 'odb-core[hf]'")
    if params["max_len"] < MIN_LEN:
        raise ValueError(f"--max-len={params['max_len']} must be >= {MIN_LEN}")
    if params["budget"] < params["max_len"] and params["oversize"] == "error":
        raise ValueError(
            f"--budget={params['budget']} is under the longest sample (--max-len="
            f"{params['max_len']}): no batch could hold it; raise the budget, lower "
            "--max-len, or pass --oversize solo|truncate"
        )
    lr = params.get("lr", 1e-3)
    if not (isinstance(lr, float | int) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"--lr={lr!r} must be a finite number > 0")
    if params["eval_samples"] < 1:
        raise ValueError(f"--eval-samples={params['eval_samples']} must be >= 1")
    if params.get("regime", "scratch") not in REGIMES:
        raise ValueError(
            f"unknown --regime {params['regime']!r}; expected one of {', '.join(REGIMES)}"
        )
    if params.get("epochs", 1) < 1:
        raise ValueError(f"--epochs={params['epochs']} must be >= 1")
    if not params.get("quality") and (
        params.get("epochs", 1) != 1 or params.get("regime", "scratch") != "scratch"
    ):
        raise ValueError("--epochs and --regime finetune need --quality")
    unknown = [s for s in params["strategies"] if s not in STRATEGIES]
    if unknown:
        raise ValueError(
            f"unknown strategy {unknown[0]!r}; expected some of {', '.join(STRATEGIES)}"
        )
    chosen = [s for s in STRATEGIES if s in params["strategies"]]
    if not params.get("quality"):
        extra = [s for s in chosen if s in RECIPES and RECIPES[s].quality_only]
        if extra:
            raise ValueError(f"strategy {extra[0]!r} is a learning-rate recipe: it needs --quality")
    elif "odb-ref" in chosen:
        raise ValueError("odb-ref has no schedule on run progress: leave it out of --quality")
    if params.get("quality") and "standard" not in chosen:
        raise ValueError(
            "--quality needs 'standard' among the strategies (its final loss is the target)"
        )
    if "grouped-estimate" in chosen and not vlm:
        raise ValueError("strategy 'grouped-estimate' groups by modality: it needs a VLM --model")
    if "trl-packed" in chosen:
        if vlm:
            raise ValueError(
                "strategy 'trl-packed' is TRL's text packing: TRL refuses packing for "
                "vision datasets, so it needs a text --model"
            )
        if importlib.util.find_spec("trl") is None:
            raise ValueError("strategy 'trl-packed' needs trl: pip install 'odb-core[trl]'")
    for name in ("grouped", "grouped-estimate"):
        if name in chosen and importlib.util.find_spec("accelerate") is None:
            raise ValueError(
                f"strategy {name!r} needs accelerate (its DataLoader sharding): "
                "pip install accelerate"
            )
    if "odb-ref" in chosen and (vlm or odb_ref_missing() is not None):
        chosen.remove("odb-ref")
    if not chosen:
        raise ValueError("no strategy to run")
    return chosen


def _validate_vlm(params: dict[str, Any]) -> None:
    if importlib.util.find_spec("PIL") is None:
        raise ValueError(f"--model {params['model']} needs Pillow: pip install 'odb-core[vlm]'")
    if params.get("regime", "scratch") != "scratch" and params.get("lora"):
        raise ValueError(
            "--regime finetune with --lora: the first training would train the adapters "
            "on a frozen random base, not a pretrained model; run --regime finetune for "
            "full fine-tuning"
        )
    if params.get("lora") and importlib.util.find_spec("peft") is None:
        raise ValueError("--lora needs peft: pip install 'odb-core[peft]'")


def workload_for(params: dict[str, Any]) -> Any:
    """The model, data and collate of `--model` (text or VLM)."""
    if params["model"] in VLM_MODELS:
        from odb_core.bench.vlm_workload import VLMWorkload

        return VLMWorkload(params["model"], params["max_len"], lora=bool(params.get("lora")))
    return TextWorkload(params["model"], params["max_len"])
