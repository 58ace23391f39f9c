"""Which trainer-library versions an adapter supports: the range its extra pins in
odb-core's installed metadata (pyproject's `[hf]`, `[accelerate]`, `[lightning]`, `[trl]`),
or the adapter's own fallback when odb-core was installed without it."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def extra_range(package: str, extra: str, fallback: str) -> str:
    """The version specifier of `package` in odb-core's `extra`, else `fallback`."""
    try:
        from importlib.metadata import PackageNotFoundError, requires

        from packaging.requirements import Requirement

        for line in requires("odb-core") or []:
            req = Requirement(line)
            if (
                req.name == package
                and req.marker is not None
                and req.marker.evaluate({"extra": extra})
                and str(req.specifier)
            ):
                return str(req.specifier)
    except (PackageNotFoundError, ImportError, ValueError):
        pass
    return fallback


def in_range(version: str, spec: str) -> bool:
    """`version` satisfies `spec`; an unparsable version does not."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) in SpecifierSet(spec)
    except InvalidVersion:
        return False


def warn_once(warned: set[str], key: str, message: str, stacklevel: int = 4) -> None:
    """`warnings.warn(message)` the first time `key` is seen in `warned`."""
    import warnings

    if key not in warned:
        warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=stacklevel)


def check_version(
    package: str,
    version: str,
    *,
    extra: str,
    fallback: str,
    missing: list[str],
    relies: str,
    warned: set[str],
) -> bool:
    """An adapter's version gate: raise `ConfigError` when the trainer library lacks a
    member the adapter relies on (`missing`), warn once when `version` is outside the
    supported range (the `extra`'s, else `fallback`); True when inside it."""
    from odb_core.errors import ConfigError

    spec = extra_range(package, extra, fallback)
    fix = f"`pip install 'odb-core[{extra}]'` ({package}{spec})"
    if missing:
        raise ConfigError(
            f"{package} {version} has no {', '.join(missing)}, which the odb-core {extra} "
            f"adapter relies on (its PRIVATE_MEMBERS); install a supported version: {fix}"
        )
    ok = in_range(version, spec)
    if not ok:
        warn_once(
            warned,
            f"version:{version}",
            f"{package} {version} is outside the range the odb-core {extra} adapter is "
            f"tested with ({spec}); it relies on {relies}: install a supported one, {fix}",
        )
    return ok


def deprecated_names(module: str, names: dict[str, tuple[str, object]]) -> Any:
    """A module `__getattr__` that serves each old name in `names` (old -> (new name,
    object)) with a `DeprecationWarning` naming the new one."""
    import warnings

    def __getattr__(name: str) -> Any:
        if name in names:
            new, obj = names[name]
            warnings.warn(
                f"{module}.{name} is deprecated: use {new}", DeprecationWarning, stacklevel=2
            )
            return obj
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


#: Every trainer member an adapter relies on that is not public API, per trainer
#: library: what the adapter uses it for, and the versions it was checked on. Each
#: adapter's `PRIVATE_MEMBERS` is its entry; its version gate raises when one is missing.
PRIVATE_MEMBERS: dict[str, dict[str, str]] = {
    "transformers": {
        "Trainer.set_initial_training_values": "its 7-tuple: the loop's sizes (5.24)",
        "Trainer.get_batch_samples": "one optimizer window per fetch (5.24)",
        "Trainer.loss_is_scaled_for_ga": "no division by gradient_accumulation_steps (5.24)",
        "Trainer.get_tp_size": "the factor average_tokens_across_devices applies (5.24)",
        "Trainer._get_collator_with_removed_columns": "remove_unused_columns (5.24)",
        # instance attributes Trainer.__init__ sets (undocumented; checked in its source)
        "Trainer.callback_handler": "its callbacks list: the adapter's goes first (5.24)",
        "Trainer.control": "should_epoch_stop / should_training_stop at the loader's end (5.24)",
        "Trainer.model_accepts_loss_kwargs": "the model sums its loss over items (5.24)",
        "Trainer.is_deepspeed_enabled": "DeepSpeed's own accumulation is refused (5.24)",
        "Trainer.label_smoother": "label smoothing on: the loss is no token sum (5.24)",
        "Trainer.accelerator": "num_processes, the factor of average_tokens_across_devices (5.24)",
        "Trainer.lr_scheduler": "the scheduler create_scheduler sets and the loop steps (5.24)",
        "TrainerState.compute_steps": "logging/eval/save steps of the planned total (5.24)",
        "ProgressCallback.training_bar": "the bar's total follows the plan (5.24)",
    },
    "accelerate": {
        "DataLoaderStateMixin.begin": "the active data loader (accelerate.data_loader; 1.16)",
        "DataLoaderStateMixin.end": "the active data loader (accelerate.data_loader; 1.16)",
        "GradientState.end_of_dataloader": "the shared gradient state (accelerate.state; 1.16)",
        "Accelerator.sync_gradients": "its setter: the loader's window boundary (1.16)",
        "Accelerator._schedulers": "the prepared schedulers: a step-sized one on a short epoch "
        "is warned about (1.16)",
        # read by odb_core.torch.trainer_checks (a live Accelerator's accumulation), from
        # sys.modules only: that module never imports accelerate
        "GradientState._shared_state": "its plugin_kwargs['num_steps']: Accelerate's own "
        "accumulation under an ODBDataLoader is refused (1.16)",
        "AcceleratorState._shared_state": "empty until an Accelerator exists (1.16)",
    },
    "lightning": {},  # public API only (checked on 2.6): its gate's `public` members
    "trl": {},  # public API only (checked on 1.16): its gate's `public` members
}


@dataclass(frozen=True)
class Gate:
    """What an adapter's version gate checks: the extra naming the supported range,
    the range it falls back to when odb-core's metadata names none, what the adapter
    relies on (for the warning), the classes its members are checked on (each
    "module:Class", imported by `gate` when the adapter's gate runs), and the public
    members it checks beside its `PRIVATE_MEMBERS` entry (each "Owner.member")."""

    extra: str
    fallback: str
    relies: str
    owners: tuple[str, ...] = ()
    public: tuple[str, ...] = ()


#: The version gate of each trainer library's adapter.
GATES: dict[str, Gate] = {
    "transformers": Gate(
        "hf",
        ">=5.24.0,<5.25",
        "how Trainer's loop counts gradient accumulation steps and normalises the loss",
        owners=(
            "transformers:Trainer",
            "transformers:TrainerState",
            "transformers.trainer_callback:ProgressCallback",
        ),
    ),
    "accelerate": Gate(
        "accelerate",
        ">=1.16,<1.17",
        "Accelerate's gradient state, no_sync and custom checkpoint objects",
        owners=(
            "accelerate.data_loader:DataLoaderStateMixin",
            "accelerate.state:GradientState",
            "accelerate.state:AcceleratorState",
            "accelerate:Accelerator",
        ),
    ),
    "lightning": Gate(
        "lightning",
        ">=2.6,<2.7",
        "Lightning's fit loop (prefetch, gradient accumulation, checkpoint hooks)",
        owners=(
            "lightning.pytorch:Trainer",
            "lightning.pytorch.strategies:Strategy",
            "lightning.pytorch.callbacks:TQDMProgressBar",
        ),
        public=(
            "Trainer.estimated_stepping_batches",
            "Strategy.handles_gradient_accumulation",
            "TQDMProgressBar.total_train_batches",
        ),
    ),
    "trl": Gate(
        "trl",
        ">=1.16,<1.17",
        "SFTTrainer's compute_loss dividing a token sum by num_items_in_batch on every "
        "loss path, and its collator's padding_free rows",
        owners=(
            "trl.trainer.sft_trainer:SFTTrainer",
            "trl.trainer.sft_trainer:DataCollatorForLanguageModeling",
        ),
        public=("SFTTrainer.compute_loss", "DataCollatorForLanguageModeling.padding_free"),
    ),
}


def has_member(owner: object, name: str) -> bool:
    """`owner` has `name`: an attribute of it, or (a class) one its methods set on
    `self` (`self.name = ...`, e.g. in `__init__`), read from the source of each
    class of its MRO that has one."""
    if hasattr(owner, name):
        return True
    if not isinstance(owner, type):
        return False
    return any(name in _self_attributes(klass) for klass in owner.__mro__)


@functools.cache
def _self_attributes(klass: type) -> frozenset[str]:
    """The names the source of `klass` assigns on `self` (`self.a = `, `self.a: T = `,
    `self.a, self.b = `; empty without a source)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            elif isinstance(t, ast.Starred):
                targets.append(t.value)
            elif (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                names.add(t.attr)
    return frozenset(names)


def gate(
    package: str,
    version: str | None = None,
    owners: Mapping[str, object] | None = None,
    warned: set[str] | None = None,
) -> bool:
    """`check_version` for the adapter of `package` (its `GATES` entry): the members
    it relies on are its `PRIVATE_MEMBERS` entry and the gate's `public` ones, each
    "Owner.member" checked on `owners` (`has_member`: an instance attribute counts
    when the class's source sets it). `version` defaults to the installed
    `package.__version__`, `owners` to the gate's (imported now), `warned` (the keys
    already warned about) to none."""
    import importlib

    spec = GATES[package]
    version = version or importlib.import_module(package).__version__
    if owners is None:
        paths = (o.split(":") for o in spec.owners)
        owners = {name: getattr(importlib.import_module(m), name) for m, name in paths}
    pairs = [n.split(".") for n in [*PRIVATE_MEMBERS[package], *spec.public]]
    missing = [f"{o}.{m}" for o, m in pairs if o in owners and not has_member(owners[o], m)]
    return check_version(
        package,
        str(version),
        extra=spec.extra,
        fallback=spec.fallback,
        missing=missing,
        relies=spec.relies,
        warned=set() if warned is None else warned,
    )
