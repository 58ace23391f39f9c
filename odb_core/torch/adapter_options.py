"""The `ODBDataLoader` options a trainer adapter takes from its user, checked in one
place for every adapter: the dataset is a dataset (the adapter builds the loader),
every option is the loader's, and the options a trainer sets itself, or that ODB
replaces, are refused with where to set them instead (or ignored with a warning);
and, for a trainer that steps the optimizer every G batches, the loader's windows
set to the trainer's (`trainer_windows`), over the trainer's ranks (`check_world`)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader

from odb_core.errors import ConfigError
from odb_core.torch.loader import ODBDataLoader

__all__ = ["LOADER_OPTIONS", "check_dataset", "check_options", "check_world", "trainer_windows"]

LOADER_OPTIONS = frozenset(inspect.signature(ODBDataLoader.__init__).parameters) - {"self"}

#: Options no adapter takes at another value than the loader's default, and why.
DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "drop_last": (False, "ODB emits every sample of an epoch exactly once: remove drop_last"),
    "batch_sampler": (None, "the loader forms the batches"),
    "with_step_info": (False, "the trainer reads the metadata carried in each batch"),
    "step_meta": (True, "the trainer reads the metadata carried in each batch"),
}


def check_dataset(adapter: str, what: str, dataset: Any, fix: str) -> None:
    """`dataset` (the adapter's argument `what`) is a dataset, not a loader."""
    if isinstance(dataset, (DataLoader, ODBDataLoader)):
        raise ConfigError(
            f"{what} is a {type(dataset).__name__}: {adapter} builds its own ODBDataLoader "
            f"from the dataset and forms token-budget batches itself. {fix}"
        )


def check_options(
    adapter: str,
    options: Mapping[str, Any],
    owned: Mapping[str, str],
    warned: set[str],
) -> dict[str, Any]:
    """The loader options of `options`, checked: each one the loader's, token_budget
    given, none of those the trainer sets (`owned`: option -> where to set it
    instead), `DEFAULT_ONLY` at their defaults; `batch_size` dropped with a warning
    (once per `warned`): the token budget sizes the batches."""
    unknown = sorted(set(options) - LOADER_OPTIONS)
    if unknown:
        raise ConfigError(f"unknown ODBDataLoader option(s) {unknown} for {adapter}")
    if "token_budget" not in options:
        raise ConfigError(f"{adapter} needs token_budget= (tokens per batch, under cost_model)")
    for key, value in options.items():
        if key in owned:
            raise ConfigError(f"{adapter} option {key}={value!r}: {owned[key]}")
        default, why = DEFAULT_ONLY.get(key, (value, ""))
        if value != default:
            raise ConfigError(f"{adapter} option {key}={value!r}: {why}")
    size = options.get("batch_size")
    if size is not None and "batch_size" not in warned:
        warned.add("batch_size")
        warnings.warn(
            f"{adapter}(batch_size={size!r}) is ignored: ODB sizes every batch by "
            "token_budget (cap the samples per batch with max_samples=)",
            UserWarning,
            stacklevel=3,
        )
    return {k: v for k, v in options.items() if k != "batch_size"}


def trainer_windows(
    options: Mapping[str, Any], steps: int, setting: str, no_tokens: str
) -> dict[str, Any]:
    """`options` with the loader's optimizer windows set to those of a trainer that
    steps the optimizer every `steps` batches (`setting`: the trainer's argument,
    e.g. "Trainer(accumulate_grad_batches)"): `grad_accum_steps` is `steps` (None
    for 1); another value raises, and so does `tokens_per_update` (windows such a
    trainer cannot follow; `no_tokens` says what to do instead)."""
    if options.get("tokens_per_update") is not None:
        raise ConfigError(f"tokens_per_update={options['tokens_per_update']!r}: {no_tokens}")
    wanted = options.get("grad_accum_steps")
    if wanted is not None and wanted != steps:
        owner, name = setting.rstrip(")").split("(")
        raise ConfigError(
            f"grad_accum_steps={wanted} but {owner}({name}={steps}): the trainer steps the "
            f"optimizer every {name} batches, so set {name}={wanted} (or leave "
            "grad_accum_steps unset: the loader's windows follow the trainer's)"
        )
    return {**options, "grad_accum_steps": steps if steps > 1 else None}


def check_world(loader: ODBDataLoader, ranks: int, trainer: str, fix: str) -> None:
    """The loader splits the data over the `ranks` processes `trainer` runs: it was
    built after the process group started (`fix`: where to build it)."""
    if loader.world_size != ranks:
        raise ConfigError(
            f"the loader was built for {loader.world_size} rank(s) but {trainer} runs "
            f"{ranks}: {fix}"
        )
