"""What `prepare_odb_loader` (odb_core.integrations.accelerate) accepts of an
Accelerator and its loader (docs/TRAINERS.md, "Accelerate"): an `ODBDataLoader` built
after the Accelerator (the world sizes agree), none of the distributed types that
run their own data or accumulation loop, Accelerate's own gradient accumulation off,
and a `DataLoaderConfiguration` whose batch options (which an ODB loader ignores)
are warned about."""

from __future__ import annotations

from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.utils import DistributedType  # type: ignore[import-untyped]

from odb_core.errors import ConfigError
from odb_core.integrations.versions import warn_once
from odb_core.torch import ODBDataLoader
from odb_core.torch.adapter_options import check_world
from odb_core.torch.trainer_checks import check_accelerate_accumulation

__all__ = ["check_accelerator"]

_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed scales and accumulates gradients in its own engine",
    DistributedType.MEGATRON_LM: "Megatron-LM runs its own data and accumulation loop",
    DistributedType.XLA: "XLA devices feed batches through their own loader",
}


def check_accelerator(accelerator: Accelerator, loader: ODBDataLoader, warned: set[str]) -> None:
    """Raise `ConfigError` for what `prepare_odb_loader(accelerator, loader)` refuses;
    warn once (keys in `warned`) for each `DataLoaderConfiguration` option it ignores."""
    if not isinstance(loader, ODBDataLoader):
        fix = (
            "build an odb_core.ODBDataLoader(dataset, token_budget=..., collate_fn=...) and "
            "pass that (a plain DataLoader goes through accelerator.prepare() instead)"
        )
        raise ConfigError(
            f"prepare_odb_loader needs an ODBDataLoader, got {type(loader).__name__}: {fix}"
        )
    if not isinstance(accelerator, Accelerator):
        raise ConfigError(
            f"prepare_odb_loader(accelerator, loader): {type(accelerator).__name__} is not "
            "an accelerate.Accelerator"
        )
    reason = _UNSUPPORTED.get(accelerator.distributed_type)
    if reason is not None:
        raise ConfigError(
            f"prepare_odb_loader does not support {accelerator.distributed_type}: {reason}"
        )
    fix = "build the ODBDataLoader after Accelerator() (which starts the process group)"
    check_world(loader, accelerator.num_processes, "the Accelerator", fix)
    check_accelerate_accumulation(accelerator.gradient_accumulation_steps)
    config = accelerator.dataloader_config
    for name, value, default in (
        ("split_batches", config.split_batches, False),
        ("dispatch_batches", config.dispatch_batches, None),
        ("data_seed", config.data_seed, None),
    ):
        if value != default:
            warn_once(
                warned,
                f"config:{name}",
                f"DataLoaderConfiguration({name}={value!r}) is ignored for an ODBDataLoader: "
                "every rank forms its own token-budget batches from its own share of the "
                "data (seed the order with ODBDataLoader(seed=...))",
                stacklevel=5,  # prepare_odb_loader's caller
            )
