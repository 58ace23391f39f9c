"""The loader as seen by a trainer that fetches batches ahead of training them
(Lightning fetches one): which step is training, and the loader's state and run
progress as of that step rather than as of the batch waiting behind it. A
checkpoint taken then resumes with the step after the one in training, so the
prefetched batch is trained once, after the resume.

    passes = PrefetchedPasses(loader)
    for batch in passes:                 # one pass: the rest of the loader's epoch
        passes.start(read_step_meta(batch).step)   # the batch starts training
        ... passes.state() ... passes.progress()
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from odb_core.errors import ODBError
from odb_core.progress import RunProgress

if TYPE_CHECKING:
    from odb_core.torch.loader import ODBDataLoader

__all__ = ["PrefetchedPasses"]


class PrefetchedPasses:
    """Passes over `loader` for a trainer that fetches up to `depth` batches ahead."""

    def __init__(self, loader: ODBDataLoader, *, depth: int = 1, hint: str = "") -> None:
        self.loader = loader
        self.depth = depth
        self.hint = hint  # how to fix a batch that did not come from these passes
        self.started = False  # a pass has begun
        self._begin()

    def _begin(self) -> None:
        self.last: int | None = None  # the step last yielded
        self.training: int | None = None  # the step that last started training
        self.ended = False  # the pass ran to the epoch's end

    def __iter__(self) -> Iterator[Any]:
        """One pass: the rest of the loader's current epoch (or the next one)."""
        loader = self.loader
        batches = iter(loader)
        self._begin()
        self.started = True
        for batch in batches:
            info = loader.step_info
            self.last = None if info is None else info.step
            yield batch
        self.ended = True

    def start(self, step: int) -> None:
        """Step `step` starts training: one of the last `depth + 1` yielded."""
        last = self.last
        if last is None or not last - self.depth <= step <= last:
            raise ODBError(
                f"training step {step} is not among the batches the loader just yielded "
                f"(last {last}){self.hint}"
            )
        self.training = step

    def state(self) -> dict[str, Any]:
        """The loader's `state_dict()` as of the step in training (before the pass's
        first when none has started): a resume continues with the step after it."""
        last, training = self.last, self.training
        if last is None:
            return self.loader.state_dict()
        if training is not None and training < last - self.depth:
            raise ODBError(
                f"the loader yielded step {last} but step {training} is training: a "
                f"prefetch deeper than {self.depth} batch(es), which is not supported"
            )
        return self.loader.state_after(training)

    def progress(self) -> RunProgress:
        """The loader's run progress as of the step in training."""
        last, training = self.last, self.training
        if last is None or training == last:
            return self.loader.run_progress
        return self.loader.progress_after(training)
