"""One rank's DataLoader: worker processes, prefetch limit, in-order delivery.

Sample j of the rank's order goes to worker j mod num_workers (PyTorch's
round-robin index assignment). The worker starts it once it has finished its
previous sample and a prefetch slot is free (sample j - depth has been consumed),
and delivery is in order (PyTorch reorders worker outputs by index). Times are
computed lazily, when the consumer asks for the next sample, so the consumer's
own blocking (the protocol window, the trainer) feeds back into the workers.
"""

from __future__ import annotations

from collections.abc import Sequence


class DataSource:
    __slots__ = (
        "_avail",
        "_consumed",
        "_depth",
        "_free",
        "_last",
        "_nw",
        "_order",
        "_prep",
        "_prep_sum",
        "_stalls",
        "_t0",
        "next",
    )

    def __init__(
        self,
        order: Sequence[int],
        prep_s: Sequence[float],
        num_workers: int,
        depth: int,
        t0: float = 0.0,
        stalls: Sequence[tuple[int, float, float]] = (),
    ) -> None:
        """`order`: global sample indices this rank reads, in order; `prep_s[i]`: seconds
        to preprocess sample i; `depth`: samples in flight (prefetch_factor x workers);
        `stalls`: (worker, at_s, duration_s) windows in which a worker makes no progress."""
        self._order = order
        self._prep = prep_s
        self._nw = max(1, num_workers)
        self._depth = max(1, depth)
        self._free = [t0] * self._nw
        self._consumed: list[float] = []
        self._avail: float | None = None
        self._last = t0
        self._t0 = t0
        self._stalls = tuple(stalls)
        self._prep_sum = 0.0
        self.next = 0

    def __len__(self) -> int:
        return len(self._order)

    @property
    def remaining(self) -> int:
        return len(self._order) - self.next

    @property
    def dry(self) -> bool:
        return self.next >= len(self._order)

    def peek(self, not_before: float = 0.0) -> float:
        """Time the next sample is delivered to the consumer (inf if dry). A worker
        starts it no earlier than `not_before` (when its index was handed out)."""
        if self._avail is not None:
            return self._avail
        j = self.next
        if j >= len(self._order):
            return float("inf")
        w = j % self._nw
        start = self._free[w]
        if not_before > start:
            start = not_before
        if j >= self._depth:
            release = self._consumed[j - self._depth]
            if release > start:
                start = release
        for worker, at, dur in self._stalls:
            if worker == w and at <= start < at + dur:
                start = at + dur
        finish = start + self._prep[self._order[j]]
        self._free[w] = finish
        avail = finish if finish > self._last else self._last
        self._avail = avail
        return avail

    def pull(self, now: float, not_before: float = 0.0) -> tuple[int, float]:
        """Consume the next sample at `now` or when it arrives; returns (index, time)."""
        avail = self.peek(not_before)
        t = avail if avail > now else now
        self._consumed.append(t)
        self._last = avail
        self._avail = None
        idx = self._order[self.next]
        self.next += 1
        self._prep_sum += self._prep[idx]
        return idx, t

    def fill_s(self, samples: int) -> float:
        """Estimated seconds for the workers to deliver `samples` more: the mean
        preprocessing time of those delivered so far (what a loader can measure)
        over the workers; inf before the first delivery."""
        if self.next == 0:
            return float("inf")
        return samples * self._prep_sum / self.next / self._nw

    def remaining_ids(self) -> list[int]:
        return list(self._order[self.next :])

    def dry_at(self) -> float:
        """When the consumer learns the source is dry: after the last delivery."""
        return self._last
