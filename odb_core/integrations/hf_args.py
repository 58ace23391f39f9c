"""What `ODBHFTrainer` takes from its user besides the Trainer's own arguments:
`ODBArguments` (the loader options `TrainingArguments` has no field for), the
checks of the `TrainingArguments` an ODB run cannot honour (`check_training_args`),
each error naming the field to change, and the loader's options of a run from both
(`run_options`). The trainer itself: `odb_core.integrations.hf`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset
from transformers import TrainingArguments

from odb_core.config import LossNormalization
from odb_core.cost import CostKind, CostModel
from odb_core.errors import ConfigError
from odb_core.integrations.versions import warn_once
from odb_core.schedule import TokenScaling
from odb_core.torch.adapter_options import check_options, trainer_windows
from odb_core.torch.measure import CostFn
from odb_core.torch.options import OPTION_DEFAULTS

__all__ = [
    "WORKER_OPTIONS",
    "ODBArguments",
    "check_training_args",
    "run_options",
    "whole_epochs",
]

#: ODBDataLoader arguments the trainer sets itself, and where to set them instead.
#: The worker options, each from `TrainingArguments(dataloader_<option>=...)`.
WORKER_OPTIONS = ("num_workers", "persistent_workers", "prefetch_factor", "multiprocessing_context")
_OWNED = {
    "dataset": "pass train_dataset= to ODBHFTrainer",
    "collate_fn": "pass data_collator= to ODBHFTrainer",
    **{k: f"set TrainingArguments(dataloader_{k}=...)" for k in (*WORKER_OPTIONS, "pin_memory")},
}

#: Why the loader's windows cannot close on loss tokens here (`trainer_windows`).
_NO_TOKENS = (
    "the HF Trainer steps the optimizer every gradient_accumulation_steps micro-batches, so "
    "windows of a token count are not supported here; use gradient_accumulation_steps, or "
    "the Accelerate adapter (odb_core.integrations.accelerate), which follows the loader's "
    "windows"
)
#: ODBArguments fields for the trainer, not the loader.
_TRAINER_FIELDS = ("loader_kwargs", "lr_tokens")


#: The `ODBDataLoader` options' defaults, which `ODBArguments` starts from.
_LOADER = OPTION_DEFAULTS


@dataclasses.dataclass
class ODBArguments:
    """ODB's loader options for `ODBHFTrainer` (what `TrainingArguments` has no field for).

    Each field but `lr_tokens` and `loader_kwargs` is the `ODBDataLoader` option of
    the same name, documented in its group (odb_core.torch.options), with the
    loader's default, except four whose default is the Trainer's:

    - `cost_model` defaults to `"padded"` (the loader's is `"packed"`): an HF
      `data_collator` pads, and a padded batch costs rows x its longest row; pass
      `"packed"` with a packing collator.
    - `shuffle` (None: True, or False with `train_sampling_strategy="sequential"`),
      `seed` (None: `data_seed`, else `seed`) and `label_shift` (None: 0 for an
      encoder-decoder model, else the loader's 1).

    Any other `ODBDataLoader` argument goes in `loader_kwargs` (or, with a dict,
    as a plain key); a field left at its default counts as not given there. The
    trainer sets `collate_fn` (`data_collator`), `grad_accum_steps`
    (`gradient_accumulation_steps`; another value raises) and the worker options
    (`dataloader_*`) itself.
    """

    token_budget: float
    cost_model: CostModel | CostKind | str = "padded"
    shuffle: bool | None = None
    seed: int | None = None
    deterministic: bool = _LOADER["deterministic"]
    max_samples: int | None = _LOADER["max_samples"]
    buffer_size: int | None = _LOADER["buffer_size"]
    max_steps_per_round: int = _LOADER["max_steps_per_round"]
    loss_normalization: LossNormalization | str = _LOADER["loss_normalization"]
    label_shift: int | None = None
    peer_timeout: float = _LOADER["peer_timeout"]
    cost_fn: CostFn | None = _LOADER["cost_fn"]
    lr_tokens: TokenScaling | None = None
    loader_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def coerce(cls, value: ODBArguments | Mapping[str, Any] | None) -> ODBArguments:
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            names = {f.name for f in dataclasses.fields(cls)} - {"loader_kwargs"}
            extra = dict(value.get("loader_kwargs") or {})
            extra.update({k: v for k, v in value.items() if k not in names | {"loader_kwargs"}})
            known = {k: v for k, v in value.items() if k in names}
            if "token_budget" not in known:
                raise ConfigError("odb= needs token_budget (tokens per batch, under cost_model)")
            return cls(**known, loader_kwargs=extra)
        raise ConfigError(
            "ODBHFTrainer needs odb=ODBArguments(token_budget=...) (or a dict of ODBDataLoader "
            f"options); got {value!r}"
        )

    def loader_options(self, warned: set[str] | None = None) -> dict[str, Any]:
        """The keyword arguments for `ODBDataLoader` (those left None or at the loader's
        default omitted), checked (`check_options`; `warned`: the keys already warned
        about)."""
        opts = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _TRAINER_FIELDS and _given(f, getattr(self, f.name))
        }
        for key, value in self.loader_kwargs.items():
            if key in opts:
                raise ConfigError(f"odb option {key!r} given twice")
            opts[key] = value
        return check_options("ODBHFTrainer odb", opts, _OWNED, set() if warned is None else warned)


def _given(field: dataclasses.Field[Any], value: Any) -> bool:
    """Whether an `ODBArguments` field says more than the loader's default: None never
    does; a value does unless the field's own default is the loader's and the value
    is that default (a field whose default is the Trainer's, such as `shuffle`, is
    passed on whenever set: `shuffle=False` must not fall to the Trainer's rule)."""
    if value is None:
        return False
    default = OPTION_DEFAULTS.get(field.name, dataclasses.MISSING)
    if default is dataclasses.MISSING:
        return True

    def same(x: Any) -> bool:
        return type(x) is type(default) and x == default

    return not (same(field.default) and same(value))


def check_training_args(
    args: TrainingArguments, odb: ODBArguments, deepspeed: bool, warned: set[str]
) -> None:
    """Raise on the `TrainingArguments` an ODB run cannot honour (and on DeepSpeed),
    warn once (per `warned`) on those it ignores; each names what to set instead."""
    if args.dataloader_drop_last:
        raise ConfigError(
            "TrainingArguments(dataloader_drop_last=True) would drop samples; ODBHFTrainer "
            "trains every sample of an epoch exactly once: set dataloader_drop_last=False"
        )
    if args.auto_find_batch_size:
        raise ConfigError(
            "auto_find_batch_size=True retries with smaller per-device batch sizes, which "
            "ODBHFTrainer does not use: set auto_find_batch_size=False and lower "
            "odb token_budget instead"
        )
    if deepspeed:
        raise ConfigError(
            "DeepSpeed counts gradient accumulation micro-steps in its own engine, which "
            "ODBHFTrainer's windows (the epoch's last one shorter) do not fit; use DDP or FSDP"
        )
    if args.n_gpu > 1:
        raise ConfigError(
            f"{args.n_gpu} GPUs in one process (torch DataParallel): ODB aligns one "
            "process per device; launch one process per GPU (torchrun) for DDP or FSDP"
        )
    if args.max_steps <= 0:
        whole_epochs(args.num_train_epochs)
    elif odb.lr_tokens is not None:
        raise ConfigError(
            f"odb lr_tokens with max_steps={args.max_steps}: the token-aware rate rides "
            "on the progress-driven schedule of an epoch run; set num_train_epochs and "
            "max_steps=-1"
        )
    default = TrainingArguments.__dataclass_fields__["per_device_train_batch_size"].default
    if args.per_device_train_batch_size != default:
        warn_once(
            warned,
            "per_device_train_batch_size",
            f"per_device_train_batch_size={args.per_device_train_batch_size} is ignored "
            "by ODBHFTrainer: batches are sized by odb token_budget (cap the samples per "
            "batch with odb max_samples=). Leave per_device_train_batch_size at its default.",
        )
    if args.train_sampling_strategy in ("group_by_length", "batch_rebalance"):
        warn_once(
            warned,
            "train_sampling_strategy",
            f"train_sampling_strategy={args.train_sampling_strategy!r} is ignored by "
            "ODBHFTrainer: the loader groups samples by cost itself (shuffle per epoch, or "
            "train_sampling_strategy='sequential' for the dataset order)",
        )


def whole_epochs(epochs: float) -> int:
    """`num_train_epochs` as the whole number of epochs an ODB run trains."""
    if epochs < 1 or int(epochs) != epochs:
        raise ConfigError(
            f"num_train_epochs={epochs!r}: ODBHFTrainer runs whole epochs, each to its end "
            "(an epoch's step count is decided online); give a whole number >= 1, or "
            "max_steps= to stop after a number of optimizer steps"
        )
    return int(epochs)


def run_options(
    odb: ODBArguments, args: TrainingArguments, dataset: Any, model: Any, warned: set[str]
) -> dict[str, Any]:
    """The `ODBDataLoader` options of a run, checked (all but the dataset and the
    `collate_fn`): `odb`'s, the Trainer's windows (`grad_accum_steps` =
    `gradient_accumulation_steps`, 1 too: the state fingerprint of checkpoints saved
    before), the worker options (`dataloader_*`) and the defaults `ODBArguments`
    documents for `shuffle`, `seed` and `label_shift`."""
    accum = args.gradient_accumulation_steps
    setting = "TrainingArguments(gradient_accumulation_steps)"
    opts = trainer_windows(odb.loader_options(warned), accum, setting, _NO_TOKENS)
    opts["grad_accum_steps"] = accum
    if not isinstance(dataset, IterableDataset):  # a stream has its own order
        opts.setdefault("shuffle", args.train_sampling_strategy != "sequential")
    opts.setdefault("seed", args.data_seed if args.data_seed is not None else args.seed)
    config = getattr(model, "config", None)
    if "label_shift" not in opts and getattr(config, "is_encoder_decoder", False):
        opts["label_shift"] = 0  # an encoder-decoder's loss does not shift its labels
    opts["pin_memory"] = bool(args.dataloader_pin_memory and torch.cuda.is_available())
    return {**opts, **{k: getattr(args, f"dataloader_{k}") for k in WORKER_OPTIONS}}
