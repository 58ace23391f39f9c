"""Optimizer windows: releasing decided steps once their window's totals are known.

`RankMachine` decides every step and every window boundary from the rounds'
all-gathers (`StepInfo.window`, `StepInfo.sync_gradients`). A step's loss scale
normalises by its whole window's global loss tokens, so it is known only when
the window closes, possibly several rounds after the window's first step was
decided. `WindowBuffer` holds the decided steps of the open window and releases
them, final, when it closes; so a window's scale is known before its first
backward, with no extra collective. Pure: every driver (the torch pipeline, the
simulator, the fuzzer, the tests) uses this one class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from odb_core.config import ProtocolConfig
from odb_core.errors import ProtocolError
from odb_core.protocol import RoundResult
from odb_core.step import StepInfo, loss_scale


class WindowBuffer:
    """Holds the steps of one rank's open optimizer window."""

    def __init__(self, config: ProtocolConfig) -> None:
        self.config = config
        self._held: list[StepInfo] = []

    @property
    def held(self) -> int:
        """Decided steps waiting for their window to close."""
        return len(self._held)

    def push(self, result: RoundResult) -> list[StepInfo]:
        """Take one round's decided steps; return those whose window closed, final.
        The epoch's end (`result.done`) closes the open window, however short."""
        return self.push_steps(result.steps, done=result.done)

    def push_steps(self, steps: Iterable[StepInfo], *, done: bool) -> list[StepInfo]:
        out: list[StepInfo] = []
        for info in steps:
            if self._held and info.window != self._held[0].window:
                raise ProtocolError(
                    f"step {info.step} opens window {info.window} while window "
                    f"{self._held[0].window} is still open"
                )
            self._held.append(info)
            if info.sync_gradients:
                out.extend(self._release())
        if done and self._held:
            out.extend(self._release())
        return out

    def _release(self) -> list[StepInfo]:
        held, self._held = self._held, []
        samples = sum(s.global_samples for s in held)
        loss = sum(s.global_loss_tokens for s in held)
        norm, world = self.config.loss_normalization, self.config.world_size
        last = len(held) - 1
        return [
            dataclasses.replace(
                s,
                sync_gradients=i == last,
                window_samples=samples,
                window_loss_tokens=loss,
                loss_scale=loss_scale(
                    norm, world, (s.local_samples, s.local_loss_tokens), (samples, loss)
                ),
            )
            for i, s in enumerate(held)
        ]
