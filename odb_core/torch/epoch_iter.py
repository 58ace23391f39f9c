"""What `iter(ODBDataLoader)` returns: the iterator of one pass over the protocol
thread's emitted steps (`EpochIterator`), which hands every step and the pass's end
back to its loader; and the pinning of the batches it yields (`make_pin`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from odb_core.errors import ODBError
from odb_core.torch.pipeline import EpochPipeline
from odb_core.torch.rounds import Emitted, _End

__all__ = ["EpochIterator", "make_pin"]


class _Loader(Protocol):
    """What an iterator reads and calls on its loader."""

    @property
    def _pipeline(self) -> EpochPipeline | None: ...

    def _record(self, item: Emitted, serial: int) -> None: ...

    def _end(self, end: _End, serial: int) -> None: ...


class EpochIterator:
    """One pass: the steps of `pipeline`, each recorded by `loader` as it is yielded
    (`serial`: the loader's selection it belongs to); `pairs` yields `(batch, info)`."""

    def __init__(
        self, loader: _Loader, pipeline: EpochPipeline, serial: int, *, pairs: bool
    ) -> None:
        self._loader = loader
        self._pipeline = pipeline
        self._serial = serial
        self._pairs = pairs
        self._finished = False

    def __iter__(self) -> EpochIterator:
        return self

    def __del__(self) -> None:
        # Dropped mid-epoch (a loop that broke out, a resume that builds a new
        # loader): no step can be taken from this pipeline any more, so stop it now
        # (as close() would) rather than leave its thread and workers waiting.
        if not self._finished:
            self._finished = True
            try:  # noqa: SIM105  (no module global: this may run at interpreter exit)
                self._pipeline.abandon()
            except Exception:
                pass

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if self._loader._pipeline is not self._pipeline:
            self._finished = True
            raise ODBError(
                "this iterator was superseded by a later iter(loader), which ended its epoch"
            )
        try:
            item = self._pipeline.get()
        except BaseException:
            self._finished = True
            raise
        if isinstance(item, _End):
            self._finished = True
            self._loader._end(item, self._serial)
            raise StopIteration
        self._loader._record(item, self._serial)
        return (item.batch, item.info) if self._pairs else item.batch


def make_pin(pin_memory: bool, device: str, stacklevel: int) -> Callable[[Any], Any] | None:
    """How each batch is pinned (`pin_memory=`; None: not pinned); without an
    accelerator it warns (at `stacklevel`) and pins nothing. `device` is accepted
    as in DataLoader."""
    if not pin_memory:
        return None
    if not torch.cuda.is_available():
        warnings.warn(
            "pin_memory=True but no accelerator is available: batches are not pinned",
            stacklevel=stacklevel,
        )
        return None
    return _pin


def _pin(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory()
    if isinstance(obj, Mapping):
        pinned = {k: _pin(v) for k, v in obj.items()}
        try:
            return type(obj)(pinned)  # type: ignore[call-arg]
        except TypeError:
            return pinned
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_pin(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pin(v) for v in obj)
    pin = getattr(obj, "pin_memory", None)
    return pin() if callable(pin) else obj
