"""Moving the round's all-gather vector between ranks.

One all-gather per round, on a dedicated gloo group created in the main process
(so it works beside NCCL training), issued with `async_op=True` and awaited with
`peer_timeout`: a dead peer closes the gloo connection, a hung one times out, and
either way the rank raises ODBPeerError instead of hanging.

Each row is `[*tag, *Contribution.to_vector(M)]` with tag = (config digest,
epoch-order digest, iteration, round): the framing integers only let a rank
detect a peer with another config, another sample order, or in another round
(for instance one that iterated the loader a different number of times) and fail
loudly instead of mixing rounds or losing samples.

A quota-mode epoch adds one collective at its close: `exchange` all-gathers each
rank's ledger (the ids it did not emit) so every rank can plan the next epoch
alike (see odb_core.ledger). Join mode never issues it.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from odb_core.errors import ConfigError, ODBPeerError


class Gathering(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> list[list[int]]: ...


class Transport(Protocol):
    rank: int
    world_size: int

    def start(self, tag: tuple[int, ...], vector: Sequence[int]) -> Gathering: ...

    def exchange(self, tag: tuple[int, ...], ids: Sequence[int]) -> list[list[int]]: ...


class _Ready:
    def __init__(self, rows: list[list[int]]) -> None:
        self._rows = rows

    def done(self) -> bool:
        return True

    def wait(self) -> list[list[int]]:
        return self._rows


class LocalTransport:
    """World size 1: the gather of one vector is that vector."""

    rank = 0
    world_size = 1

    def start(self, tag: tuple[int, ...], vector: Sequence[int]) -> Gathering:
        return _Ready([list(vector)])

    def exchange(self, tag: tuple[int, ...], ids: Sequence[int]) -> list[list[int]]:
        return [list(ids)]


class GlooTransport:
    """All-gather on a gloo group of all ranks of the default process group."""

    def __init__(self, peer_timeout: float) -> None:
        if not dist.is_gloo_available():
            raise ConfigError(
                "ODBDataLoader syncs ranks over a gloo process group, but this torch build "
                "has no gloo backend; cross-rank alignment cannot work here"
            )
        self.timeout = peer_timeout
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # A collective on the default group: every rank constructs its loader in the
        # same order, as it does for any process group.
        self.group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=peer_timeout)
        )

    def start(self, tag: tuple[int, ...], vector: Sequence[int]) -> Gathering:
        row = torch.tensor([*tag, *vector], dtype=torch.int64)
        out = [torch.empty_like(row) for _ in range(self.world_size)]
        try:
            work = dist.all_gather(out, row, group=self.group, async_op=True)
        except RuntimeError as exc:
            raise ODBPeerError(
                f"rank {self.rank}: could not start the all-gather of round {tag[-1]}: {exc}"
            ) from exc
        assert work is not None
        return _GlooGathering(self, work, out, tag)

    def exchange(self, tag: tuple[int, ...], ids: Sequence[int]) -> list[list[int]]:
        """Every rank's ledger ids, in rank order. One all_gather_object on the gloo
        group, whose timeout is peer_timeout."""
        out: list[object] = [None] * self.world_size
        try:
            dist.all_gather_object(out, (tag, list(ids)), group=self.group)
        except RuntimeError as exc:
            raise ODBPeerError(
                f"rank {self.rank}: a peer rank died or hung (no ledger exchange at the close "
                f"of the epoch within peer_timeout={self.timeout:g}s): {exc}"
            ) from exc
        rows: list[list[int]] = []
        for peer, got in enumerate(out):
            if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], list)):
                raise ODBPeerError(f"rank {peer} sent a malformed ledger {got!r}")
            if tuple(got[0]) != tag:
                raise ODBPeerError(
                    f"rank {self.rank} closed the epoch with (config digest, order digest, "
                    f"iteration, round) = {tag} but rank {peer} with {tuple(got[0])}"
                )
            rows.append(got[1])
        return rows


class _GlooGathering:
    def __init__(
        self, t: GlooTransport, work: dist.Work, out: list[torch.Tensor], tag: tuple[int, ...]
    ) -> None:
        self._t, self._work, self._out, self._tag = t, work, out, tag

    def done(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self) -> list[list[int]]:
        t = self._t
        try:
            self._work.wait(timeout=datetime.timedelta(seconds=t.timeout))
        except RuntimeError as exc:
            raise ODBPeerError(
                f"rank {t.rank}: a peer rank died or hung (no all-gather of round "
                f"{self._tag[-1]} within peer_timeout={t.timeout:g}s): {exc}"
            ) from exc
        rows: list[list[int]] = [o.tolist() for o in self._out]
        n = len(self._tag)
        for peer, row in enumerate(rows):
            if tuple(row[:n]) != self._tag:
                raise ODBPeerError(
                    f"rank {t.rank} sent (config digest, order digest, iteration, round) = "
                    f"{self._tag} but rank {peer} sent {tuple(row[:n])}: the ranks use "
                    "different loader configs, different sample orders (seed every rank's "
                    "sampler alike), or iterate the loader differently (every rank must run "
                    "the same epochs and stop at the same step)"
                )
        return [row[n:] for row in rows]
