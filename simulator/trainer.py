"""The accelerator side: DDP steps on W ranks, their timing, and the metrics.

Every strategy hands the trainer one global step at a time: per rank a `Slot`
(the batch that rank runs, or a pad/idle slot) and the time the slowest rank's
batch became available. The trainer decides nothing about batching; it charges
time with the hardware model and counts what ran.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from simulator.hardware import HardwareModel


class Slot(NamedTuple):
    """What one rank runs in one step."""

    ids: tuple[int, ...]  # real sample ids (empty for a pad step)
    real_tokens: int
    compute_tokens: int  # tokens the accelerator processes (padded if padded)
    sum_sq: int  # sum over sequences of len^2 as computed (padded if padded)
    mem_tokens: int  # tokens resident in activation memory
    cost: float  # cost under the strategy's cost model (for budget fill), 0 for pads
    is_pad: bool = False
    visual: int = 0  # visual tokens (a fitted CPU profile prices the vision tower by them)


@dataclass
class TailStep:
    start: float
    end: float
    ready: float
    compute_end: list[float]
    pad: list[bool]


@dataclass
class Trainer:
    hw: HardwareModel
    world: int
    budget: float
    pad_slot: Slot
    stragglers: dict[int, float] = field(default_factory=dict)
    tail_window: int = 12
    n_samples: int = 0
    stop_at: float = float("inf")  # a rank died: no step starts after this

    end: float = 0.0
    steps: int = 0
    real_samples: int = 0
    real_tokens: int = 0
    compute_tokens: int = 0
    pad_slots: int = 0
    oom_slots: int = 0
    data_wait_s: float = 0.0
    fill_sum: float = 0.0
    fill_n: int = 0
    first_pad_step: int | None = None
    first_pad_time: float = 0.0
    halted: bool = False
    tail: deque[TailStep] = field(default_factory=deque)
    # Where the wall time goes (seconds, summed over steps): the ranks' mean compute,
    # of it the share spent on padding tokens, the wait for the slowest rank (max -
    # mean: imbalance and the pad steps of the tail), and the per-step overhead
    # (exposed all-reduce + optimizer). With data_wait_s they add up to the wall time.
    busy_s: float = 0.0
    padding_s: float = 0.0
    imbalance_s: float = 0.0
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        self.delivered = np.zeros(self.n_samples, dtype=np.int64)
        # A fitted CPU profile (simulator.cpu_profile) prices real, padding and
        # visual tokens apart; the roofline prices computed tokens only.
        self._slot_s = getattr(self.hw, "slot_s", None)
        self._ar = self.hw.allreduce_s(self.world)
        self._bucket = self.hw.last_bucket_s()
        self._opt = self.hw.optimizer_s()
        self._bwd = self.hw.backward_fraction()
        self._cap = self.hw.token_capacity
        self._compute_cache: dict[tuple[int, int], float] = {}

    def _compute(self, tokens: int, sum_sq: int) -> float:
        key = (tokens, sum_sq)
        t = self._compute_cache.get(key)
        if t is None:
            t = self.hw.compute_s(tokens, sum_sq)
            if len(self._compute_cache) < 200_000:
                self._compute_cache[key] = t
        return t

    def step(self, ready: float, slots: Sequence[Slot]) -> bool:
        """Run one aligned step once every rank's batch is available at `ready`.
        Returns False (and runs nothing) if a dead rank stops the step."""
        prev = self.end
        start = ready if ready > prev else prev
        if start >= self.stop_at:
            self.halted = True
            return False
        self.data_wait_s += start - prev
        gpu_max = 0.0
        gpu_sum = 0.0
        ends: list[float] | None = [] if self._want_tail() else None
        any_pad = False
        for r, slot in enumerate(slots):
            if slot.is_pad:
                any_pad = True
                self.pad_slots += 1
                s = self.pad_slot
            else:
                s = slot
                self.real_samples += len(s.ids)
                self.real_tokens += s.real_tokens
                for i in s.ids:
                    self.delivered[i] += 1
                if self.budget > 0:
                    # a solo oversize batch counts as full, not as more than full
                    self.fill_sum += min(1.0, s.cost / self.budget)
                    self.fill_n += 1
            self.compute_tokens += s.compute_tokens
            if s.mem_tokens > self._cap:
                self.oom_slots += 1
            if self._slot_s is not None:
                g = self._slot_s(s.real_tokens, s.compute_tokens, s.visual)
            else:
                g = self._compute(s.compute_tokens, s.sum_sq)
            f = self.stragglers.get(r)
            if f is not None:
                g *= f
            if g > gpu_max:
                gpu_max = g
            gpu_sum += g
            if s.compute_tokens:
                self.padding_s += g * (1 - s.real_tokens / s.compute_tokens) / self.world
            if ends is not None:
                ends.append(start + g)
        exposed = max(self._ar - self._bwd * gpu_max, self._bucket) if self._ar > 0 else 0.0
        end = start + gpu_max + exposed + self._opt
        mean = gpu_sum / len(slots) if slots else 0.0
        self.busy_s += mean
        self.imbalance_s += gpu_max - mean
        self.overhead_s += exposed + self._opt
        if any_pad and self.first_pad_step is None:
            self.first_pad_step = self.steps
            self.first_pad_time = start
        if ends is not None:
            self.tail.append(TailStep(start, end, ready, ends, [s.is_pad for s in slots]))
            while len(self.tail) > self.tail_window:
                self.tail.popleft()
        self.end = end
        self.steps += 1
        return True

    def _want_tail(self) -> bool:
        return self.world <= 256

    def metrics(self) -> dict[str, Any]:
        wall = self.end
        n_dup = int((self.delivered > 1).sum())
        n_lost = int((self.delivered == 0).sum())
        tail_steps = 0 if self.first_pad_step is None else self.steps - self.first_pad_step
        tail_s = 0.0 if self.first_pad_step is None else wall - self.first_pad_time
        return {
            "wall_s": round(wall, 3),
            "samples_per_s": round(self.real_samples / wall, 3) if wall > 0 else 0.0,
            "tokens_per_s": round(self.real_tokens / wall, 1) if wall > 0 else 0.0,
            "emitted_samples": self.real_samples,
            "real_tokens": self.real_tokens,
            "padding_ratio": round(1 - self.real_tokens / self.compute_tokens, 4)
            if self.compute_tokens
            else 0.0,
            "budget_fill": round(self.fill_sum / self.fill_n, 4) if self.fill_n else 0.0,
            "steps": self.steps,
            "pad_steps": self.pad_slots,
            "tail_steps": tail_steps,
            "tail_s": round(tail_s, 3),
            "data_wait_s": round(self.data_wait_s, 3),
            "data_wait_fraction": round(self.data_wait_s / wall, 4) if wall > 0 else 0.0,
            "time_s": {
                "data_wait": round(self.data_wait_s, 3),
                "compute": round(self.busy_s, 3),
                "of_which_padding": round(self.padding_s, 3),
                "rank_imbalance": round(self.imbalance_s, 3),
                "step_overhead": round(self.overhead_s, 3),
            },
            "oom_steps": self.oom_slots,
            "lost_ids": n_lost,
            "duplicated_ids": n_dup,
        }

    def timeline(self) -> list[dict[str, Any]]:
        return [
            {
                "start": round(t.start, 6),
                "end": round(t.end, 6),
                "ready": round(t.ready, 6),
                "compute_end": [round(x, 6) for x in t.compute_end],
                "pad": t.pad,
            }
            for t in self.tail
        ]
