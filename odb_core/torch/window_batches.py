"""The loader's optimizer windows as a trainer that takes one window at a time meets
them (the HF Trainer fetches a window's batches before training them): the batches
up to the one that closes the window, each with its `StepInfo`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from odb_core.errors import ODBError
from odb_core.torch.meta import STEP_META_KEY, read_step_meta

if TYPE_CHECKING:
    from odb_core.step import StepInfo
    from odb_core.torch.loader import ODBDataLoader

__all__ = ["next_window"]


def next_window(
    batches: Iterator[Any], loader: ODBDataLoader
) -> tuple[list[Any], list[StepInfo | None]]:
    """The next batches of `batches` (an iterator over `loader`) up to and including
    the one whose step closes its optimizer window (`sync_gradients`), fewer at the
    epoch's end (none once it has ended), and the loader's `step_info` of each."""
    window: list[Any] = []
    infos: list[StepInfo | None] = []
    for batch in batches:
        if not isinstance(batch, Mapping) or STEP_META_KEY not in batch:
            raise ODBError(
                "the train dataloader yielded a batch without ODB step metadata "
                f"({STEP_META_KEY!r}); the collate_fn (data_collator) must return a dict"
            )
        window.append(batch)
        infos.append(loader.step_info)
        if read_step_meta(batch).sync_gradients:
            break
    return window, infos
