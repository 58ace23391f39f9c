"""TRL adapter: `ODBSFTTrainer`, TRL's `SFTTrainer` on an `ODBDataLoader`.

    trainer = ODBSFTTrainer(
        model=model,
        args=SFTConfig(output_dir="out", num_train_epochs=3, gradient_accumulation_steps=4),
        train_dataset=dataset,            # what SFTTrainer takes: text, prompt-completion, chat
        processing_class=tokenizer,
        odb=ODBArguments(token_budget=16384),  # padding_free=True: cost_model="packed"
    )
    trainer.train()

The class is `ODBHFTrainer` (odb_core.integrations.hf) mixed in before TRL's
`SFTTrainer`: the loader, its windows, the schedule and the checkpoints are
ODBHFTrainer's; the dataset preparation (chat template, tokenization, EOS,
completion-only and assistant-only label masks) and the collator are TRL's.
`padding_free=False` collates with TRL's padding collator (odb-padded, cost model
"padded"); `padding_free=True` with its flattening one (odb-packed, cost model
"packed"): each token-budget batch becomes one row whose position ids restart at
every sample, so no sample attends to another and each sample's first label is
masked, as the loader's loss-token count (`labels[1:] != -100`) already assumes.

The loss: TRL's `compute_loss` divides a summed token loss by `num_items_in_batch`
on every path (its fused LM head, label smoothing, `compute_loss_func`) and
multiplies by the world size under `average_tokens_across_devices`; ODBHFTrainer
passes the window's loss tokens (`meta.loss_denominator`) divided accordingly, so
the gradient is the per-token mean over the window's samples on every rank
(`loss_takes_num_items`).

What TRL offers that an ODB run cannot honour raises at construction, naming the
option and its fix (`check_sft_config`): `packing=True` (offline packing before the
loader sees a sample), a `max_length` one sample of which exceeds the token budget,
`max_length` with `padding_free=True` (TRL does not truncate there), and a cost
model that does not describe TRL's collator. A `max_length` whose truncation left a
sample without a loss token (TRL drops those) raises; samples truncated to it are
warned about. docs/TRAINERS.md, "TRL SFTTrainer".
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, cast

from trl.trainer.sft_config import SFTConfig
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling, SFTTrainer

from odb_core.config import make_cost_model
from odb_core.cost import BatchStats, CostKind, CostModel
from odb_core.errors import ConfigError
from odb_core.integrations import versions
from odb_core.integrations.hf import ODBArguments, ODBHFTrainer

__all__ = [
    "SUPPORTED_TRL",
    "ODBArguments",
    "ODBSFTTrainer",
    "check_sft_config",
    "check_trl_version",
]

#: The trl versions this adapter is tested with when odb-core's metadata names no
#: `[trl]` range (`versions.GATES`).
SUPPORTED_TRL = versions.GATES["trl"].fallback
_warned: set[str] = set()


def check_trl_version(version: str | None = None) -> bool:
    """Warn once when `trl.__version__` is outside the supported range; raise
    `ConfigError` when TRL lacks a member the adapter relies on."""
    return versions.gate("trl", version, warned=_warned)


#: The cost models that describe each of TRL's text collators.
_PACKED_KINDS = (CostKind.PACKED.value, CostKind.ATTENTION.value)
_PADDED_KINDS = (CostKind.PADDED.value,)


def _cost_model(odb: ODBArguments) -> CostModel:
    model = odb.cost_model
    if isinstance(model, (str, CostKind)):
        return make_cost_model(model)
    return model


def check_sft_config(config: Any, odb: ODBArguments) -> None:
    """Raise `ConfigError` on an `SFTConfig` an ODB run cannot honour, before TRL
    prepares the dataset; each message names the option and the fix."""
    if not isinstance(config, SFTConfig):
        got = "none" if config is None else f"a {type(config).__name__}"
        raise ConfigError(
            f"ODBSFTTrainer needs args=SFTConfig(...) (got {got}): its packing, padding_free "
            "and max_length are checked against the odb token budget before TRL prepares "
            "the dataset"
        )
    if config.packing:
        raise ConfigError(
            f"SFTConfig(packing=True, packing_strategy={config.packing_strategy!r}) packs the "
            "dataset offline into max_length rows before the ODBDataLoader sees a sample (and "
            "its 'bfd' truncates what does not fit a row): the loader would batch pre-packed "
            "rows. Set packing=False; to pack online, set padding_free=True, max_length=None "
            "and odb cost_model='packed' (each token-budget batch becomes one packed row)"
        )
    cost = _cost_model(odb)
    if config.padding_free and config.max_length is not None:
        raise ConfigError(
            f"SFTConfig(padding_free=True, max_length={config.max_length}): TRL does not "
            "truncate padding-free samples, so max_length would not hold. Set max_length=None: "
            f"the loader's oversize policy (odb oversize=, default 'error') handles a sample "
            f"above token_budget={odb.token_budget}"
        )
    length = config.max_length
    if length is not None:
        one = cost.cost(BatchStats(1, length, length, length * length, length, 0, 0))
        if one > odb.token_budget:
            raise ConfigError(
                f"SFTConfig(max_length={length}) is above odb token_budget={odb.token_budget} "
                f"(one sample of {length} tokens costs {one:g} under cost_model "
                f"{cost.name!r}): TRL would keep samples the loader cannot batch. Set "
                f"max_length <= {odb.token_budget}, max_length=None (the loader's oversize "
                "policy then handles long samples), or raise token_budget"
            )


# TRL's base declares loss_is_scaled_for_ga = None (the Trainer decides); ODBHFTrainer's
# True comes first in the MRO: the core's scale covers the window.
class ODBSFTTrainer(ODBHFTrainer, SFTTrainer):  # type: ignore[misc]
    """TRL's `SFTTrainer` whose train dataloader is an `ODBDataLoader` (see the module
    docstring): `odb` as for `ODBHFTrainer`, everything else `SFTTrainer`'s, `args`
    an `SFTConfig` (`check_sft_config`)."""

    def __init__(self, *args: Any, odb: ODBArguments | Mapping[str, Any], **kwargs: Any) -> None:
        check_trl_version()
        odb_args = ODBArguments.coerce(odb)
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        check_sft_config(config, odb_args)
        given: Any = kwargs.get("train_dataset", args[3] if len(args) > 3 else None)
        rows = len(given) if hasattr(given, "__len__") else None
        super().__init__(*args, odb=odb_args, **kwargs)
        self._check_collator_cost(odb_args)
        self._check_prepared(rows, cast(SFTConfig, self.args).max_length)

    def _check_prepared(self, rows: int | None, max_length: int | None) -> None:
        """What TRL's preparation did to the samples under `max_length`: dropping one
        (left without a loss token by truncation) raises; samples at `max_length`
        tokens (those TRL cut, and any exactly that long) are warned about."""
        prepared: Any = self.train_dataset
        if max_length is None or not hasattr(prepared, "column_names"):
            return  # no truncation, or a stream (counted as it is read)
        kept = len(prepared)
        if rows is not None and kept < rows:
            raise ConfigError(
                f"SFTConfig(max_length={max_length}): TRL's dataset preparation dropped "
                f"{rows - kept} of {rows} samples, left without a loss token once truncated "
                "to max_length. Set max_length=None (the loader's oversize policy then "
                "handles a long sample) or a larger max_length"
            )
        cut = sum(1 for ids in prepared["input_ids"] if len(ids) >= max_length)
        if cut:
            warnings.warn(
                f"SFTConfig(max_length={max_length}): {cut} of {kept} samples are "
                f"{max_length} tokens long after TRL's preparation, which truncates longer "
                "ones to it; set max_length=None to keep every token (the loader's oversize "
                "policy then handles a sample above token_budget)",
                UserWarning,
                stacklevel=3,
            )

    def loss_takes_num_items(self) -> bool:
        """Always: every loss path of `SFTTrainer.compute_loss` divides by
        `num_items_in_batch` when it is given."""
        return True

    def _check_collator_cost(self, odb: ODBArguments) -> None:
        """TRL's text collator (the one it builds when no `data_collator` is passed)
        against the cost model: flattening rows are packed, padding ones padded."""
        collator = self.data_collator
        if not isinstance(collator, DataCollatorForLanguageModeling):
            return  # the user's collator, or TRL's vision one: the user's cost model
        name = _cost_model(odb).name
        flat = collator.padding_free
        kinds = _PACKED_KINDS if flat else _PADDED_KINDS
        if name not in kinds:
            want = "packed" if flat else "padded"
            raise ConfigError(
                f"SFTConfig(padding_free={flat}) collates each batch "
                f"{'into one packed row' if flat else 'padded to its longest sample'}, but "
                f"odb cost_model={name!r} measures batches another way, so token_budget would "
                f"not bound them: set odb cost_model={want!r}, or padding_free={not flat}"
            )
