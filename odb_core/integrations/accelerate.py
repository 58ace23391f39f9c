"""Accelerate adapter: `prepare_odb_loader(accelerator, loader)`.

    accelerator = Accelerator()                        # gradient_accumulation_steps=1
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loader = ODBDataLoader(ds, token_budget=8192, collate_fn=collate, shuffle=True,
                           grad_accum_steps=4)           # the optimizer windows: the loader's
    train = prepare_odb_loader(accelerator, loader)      # after Accelerator(): the process group
    for epoch in range(epochs):                          # each iteration is the next epoch
        for batch in train:                              # on accelerator.device
            meta = pop_step_meta(batch)
            with train.accumulate(model):                # no_sync unless the window closes
                accelerator.backward(scaled_loss(meta, model(**batch).loss))
                optimizer.step(); scheduler.step(); optimizer.zero_grad()  # only at window ends

What Accelerate 1.16 does (`prepare()` wraps only torch DataLoaders, `accumulate()`
counts its own windows, `backward()` divides by `gradient_accumulation_steps`) and
what the adapter does about it: docs/TRAINERS.md, "Accelerate". What
`prepare_odb_loader` refuses or warns about: `odb_core.integrations.accelerate_checks`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.data_loader import DataLoaderStateMixin  # type: ignore[import-untyped]
from accelerate.state import GradientState  # type: ignore[import-untyped]
from accelerate.utils import send_to_device  # type: ignore[import-untyped]

from odb_core.errors import ConfigError
from odb_core.integrations import versions
from odb_core.integrations.accelerate_checks import check_accelerator
from odb_core.integrations.short_schedule import warn_short_schedule
from odb_core.progress import RunProgress
from odb_core.torch import ODBDataLoader
from odb_core.torch.checkpoint import gather_states, load_states
from odb_core.torch.trainer_checks import check_accelerate_accumulation

__all__ = [
    "PRIVATE_MEMBERS",
    "SUPPORTED_ACCELERATE",
    "ODBAcceleratedLoader",
    "check_accelerate_version",
    "prepare_odb_loader",
]

#: Accelerate versions the adapter is tested with when odb-core's metadata names no
#: `[accelerate]` range (`versions.GATES`).
SUPPORTED_ACCELERATE = versions.GATES["accelerate"].fallback
#: Accelerate internals it relies on (`versions.PRIVATE_MEMBERS`).
PRIVATE_MEMBERS = versions.PRIVATE_MEMBERS["accelerate"]
_warned: set[str] = set()


def check_accelerate_version(version: str | None = None) -> bool:
    """Warn once when `accelerate.__version__` is outside the supported range; raise
    `ConfigError` when a member the adapter relies on is missing."""
    return versions.gate("accelerate", version, warned=_warned)


def prepare_odb_loader(
    accelerator: Accelerator,
    loader: ODBDataLoader,
    *,
    device_placement: bool | None = None,
    register_for_checkpointing: bool = True,
) -> ODBAcceleratedLoader:
    """Bridge an `ODBDataLoader` into `accelerator`: batches on `accelerator.device`,
    `accelerator.sync_gradients` following the loader's optimizer windows,
    `end_of_dataloader` on the epoch's last batch, and the loader's state in
    `accelerator.save_state` / `load_state`. Call it on every rank, in the same
    order, after `Accelerator()` (and build the loader after it too: the
    Accelerator starts the process group the loader splits the data over)."""
    return ODBAcceleratedLoader(
        accelerator,
        loader,
        device_placement=device_placement,
        register_for_checkpointing=register_for_checkpointing,
    )


class ODBAcceleratedLoader(DataLoaderStateMixin):  # type: ignore[misc]
    """What `prepare_odb_loader` returns: iterate it instead of the loader."""

    def __init__(
        self,
        accelerator: Accelerator,
        loader: ODBDataLoader,
        *,
        device_placement: bool | None = None,
        register_for_checkpointing: bool = True,
    ) -> None:
        check_accelerate_version()
        check_accelerator(accelerator, loader, _warned)
        self.accelerator = accelerator
        self.loader = loader
        self.device_placement = (
            accelerator.device_placement if device_placement is None else device_placement
        )
        self.gradient_state = GradientState()  # Accelerate's shared singleton
        self._expected_sync: bool | None = None
        if register_for_checkpointing:
            accelerator.register_for_checkpointing(self)

    # ---- the data-loader surface -----------------------------------------------------

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def epoch(self) -> int:
        """The loader's epoch (the one running or, between epochs, the next)."""
        return self.loader.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select an epoch (the loader advances its own epochs otherwise)."""
        self.loader.set_epoch(epoch)

    def __len__(self) -> int:
        """The loader's upper estimate of the epoch's steps; an epoch may differ, and
        iteration ends when the loader ends the epoch, not at this count."""
        return len(self.loader)

    @property
    def run_progress(self) -> RunProgress:
        """The loader's run progress (no lookahead here: its last batch is the one in
        training), the clock of `ProgressLR(optimizer, train, epochs=...)`."""
        return self.loader.run_progress

    def __iter__(self) -> Iterator[Any]:
        self._expected_sync = None
        it = iter(self.loader)  # checks Accelerate's own accumulation (trainer_checks)
        # the epoch's steps: the last step's index + 1 (a resumed epoch starts midway)
        estimate, epoch, steps = len(self.loader), self.loader.epoch, 0
        self.begin()
        try:
            for batch in it:
                self._check_sync_untouched()
                info = self.loader.step_info  # the batch just yielded (no lookahead here)
                assert info is not None
                steps = info.step + 1
                check_accelerate_accumulation(self.accelerator.gradient_accumulation_steps)
                self.end_of_dataloader = self.loader.epoch_closed
                self._expected_sync = bool(info.sync_gradients)
                self.accelerator.sync_gradients = self._expected_sync
                if self.device_placement:
                    batch = send_to_device(
                        batch, self.accelerator.device, non_blocking=self.accelerator.non_blocking
                    )
                yield batch
            self._check_short_schedule(epoch, steps, estimate)
        finally:
            self._expected_sync = None
            self.accelerator.sync_gradients = True  # Accelerate's state outside accumulation
            self.end()

    def _check_short_schedule(self, epoch: int, steps: int, estimate: int) -> None:
        """At the end of an epoch shorter than the `len()` it reported: warn when a
        step-sized scheduler was prepared (the first point the shortfall is known)."""
        if steps < estimate:
            warn_short_schedule(
                _warned,
                self.accelerator._schedulers,
                ran=f"epoch {epoch} ran {steps} steps where len(train) estimated "
                f"{estimate} (an upper estimate, as in len(train) * epochs)",
                fix="ProgressLR(optimizer, train, epochs=E), prepared as usual,",
                stacklevel=5,
            )

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """`accelerator.no_sync(model)` for every model unless the current step closes
        its optimizer window (use it where `accelerator.accumulate(model)` would go)."""
        sync = self.accelerator.sync_gradients
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in models:
                    stack.enter_context(self.accelerator.no_sync(model))
            yield

    def _check_sync_untouched(self) -> None:
        expected = self._expected_sync
        if expected is not None and self.accelerator.sync_gradients != expected:
            raise ConfigError(
                f"accelerator.sync_gradients was changed to {self.accelerator.sync_gradients} "
                f"during a step the ODB loader marked sync_gradients={expected}: "
                "accelerator.accumulate(model) re-decides the windows from its own step "
                "counter; use `with train.accumulate(model):` (train = prepare_odb_loader(...)) "
                "so the optimizer steps where the loader's window closes"
            )

    # ---- checkpointing (accelerator.save_state / load_state) ------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every rank's loader state (`odb_core.torch.checkpoint`; a collective: call
        it on every rank, as `accelerator.save_state` does)."""
        return gather_states(self.loader)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the loader (checked first): this rank's own state at the same world
        size, every rank's merged at another. Call prepare_odb_loader in the same order
        as in the run that saved it (Accelerate loads registered objects by position)."""
        load_states(self.loader, state)

    def close(self) -> None:
        """`ODBDataLoader.close()`: call it on every rank when training ends, before
        `accelerator.end_training()`."""
        self.loader.close()

    def __repr__(self) -> str:
        return f"<ODBAcceleratedLoader of {self.loader!r} on {self.accelerator.device}>"
