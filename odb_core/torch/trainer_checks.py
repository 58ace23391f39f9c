"""What `iter(ODBDataLoader)` checks of the trainer loop iterating it: the upgrade
traps that would otherwise train silently wrong. Reads only modules the user has
already imported (`sys.modules`); imports no trainer library."""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

from odb_core.errors import ConfigError

#: A class attribute the odb-core trainer adapters set on what they iterate the
#: loader from (so the checks below know the loop is an adapter's).
ADAPTER_FLAG = "_odb_adapter"


def check_trainer_context(loader: Any) -> None:
    """Raise or warn, naming the fix, when the loop iterating `loader` is a trainer's
    that would re-decide what the loader decides."""
    _check_accelerate_accumulation()
    _check_plain_hf_trainer(loader)


def _check_accelerate_accumulation() -> None:
    """A live Accelerator's own accumulation (`check_accelerate_accumulation`). The
    private members read here are in `versions.PRIVATE_MEMBERS["accelerate"]`
    (tests/test_trainer_checks_members.py holds the two equal)."""
    state = sys.modules.get("accelerate.state")
    gradient_state = getattr(state, "GradientState", None)
    shared = getattr(gradient_state, "_shared_state", None)
    if not shared or not getattr(state.AcceleratorState, "_shared_state", None):  # type: ignore[union-attr]
        return  # no live Accelerator
    check_accelerate_accumulation(dict(shared).get("plugin_kwargs", {}).get("num_steps", 1))


def check_accelerate_accumulation(steps: int | None) -> None:
    """Accelerate's own accumulation (`Accelerator(gradient_accumulation_steps=G > 1)`)
    divides every loss by G and counts its own windows over the loader's
    window-normalised losses: raise naming the fix (also the Accelerate adapter's check)."""
    steps = int(steps or 1)
    if steps > 1:
        raise ConfigError(
            f"an ODBDataLoader under Accelerator(gradient_accumulation_steps={steps}): "
            f"accelerator.backward() divides every loss by {steps} and accelerator.accumulate() "
            "counts its own windows, while the loader's loss scale already normalises over its "
            "window (the gradients would be wrong). Use Accelerator(gradient_accumulation_steps=1)"
            f", ODBDataLoader(grad_accum_steps={steps}) and train = odb_core.integrations."
            "accelerate.prepare_odb_loader(accelerator, loader) (not accelerator.prepare(loader))"
        )


def _check_plain_hf_trainer(loader: Any) -> None:
    """A plain `transformers.Trainer` sizes its epochs from len(loader), an estimate:
    it cuts epochs (and stops short of max_steps).

    Which loop iterates the loader is known only from the caller frames (`self` of
    a Trainer method up the stack): a Trainer marks no global state while it trains
    (its Accelerator is the same under ODBHFTrainer), so the walk stays. It reads
    public names only: the frames' `self`, `Trainer` and `args.max_steps`."""
    trainer_mod = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(trainer_mod, "Trainer", None)
    if trainer_cls is None or getattr(loader, "_plain_trainer_warned", False):
        return
    here = inspect.currentframe()  # this function's frame; its caller's caller first
    frame: Any = None if here is None or here.f_back is None else here.f_back.f_back
    for _ in range(12):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if isinstance(owner, trainer_cls):
            if getattr(type(owner), ADAPTER_FLAG, False):
                return
            loader._plain_trainer_warned = True
            max_steps = getattr(getattr(owner, "args", None), "max_steps", -1)
            cut = (
                f"max_steps={max_steps} would stop early (each epoch cut at len(loader) // "
                "gradient_accumulation_steps optimizer steps)"
                if max_steps and max_steps > 0
                else "epochs would be cut at len(loader)"
            )
            warnings.warn(
                f"a plain {type(owner).__name__} (transformers.Trainer) is iterating an "
                f"ODBDataLoader: it sizes its loop from len(loader), an estimate, so {cut}, "
                "and it normalises the loss itself. Use odb_core.integrations.hf.ODBHFTrainer "
                "(train_dataset=..., odb=ODBArguments(token_budget=...))",
                UserWarning,
                stacklevel=3,
            )
            return
        frame = frame.f_back


def has_vision_tower(model: Any) -> bool:
    """A multimodal model (its config, or a wrapper's, has a `vision_config`)."""
    inner = getattr(model, "module", model)
    return getattr(getattr(inner, "config", None), "vision_config", None) is not None


def find_unused_for_vision(model: Any, training_args: Any) -> None:
    """Set `training_args.ddp_find_unused_parameters = True` for a model with a vision
    tower when the user left it None: a text-only batch leaves the vision tower without
    gradients, and DDP without `find_unused_parameters` then fails the next step
    ("Expected to have finished reduction"). transformers' own default turns it off
    under activation checkpointing, which since 5.x is non-reentrant and works with
    it. An explicit value is the user's."""
    if training_args is None or not has_vision_tower(model):
        return
    if getattr(training_args, "ddp_find_unused_parameters", False) is None:
        training_args.ddp_find_unused_parameters = True
