"""Moving the round's all-gather vector between ranks.

One all-gather per round, on a dedicated gloo group created in the main process
(so it works beside NCCL training), issued with `async_op=True` and awaited with
`peer_timeout`: a dead peer closes the gloo connection, a hung one times out, and
either way the rank raises ODBPeerError instead of hanging. The error names the
peer and says whether it died, hung or failed (`PeerBoard`: heartbeats, process
states and failure notes on the default store; docs/FAULTS.md).

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

import atexit
import contextlib
import datetime
import json
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from odb_core.errors import ConfigError, ODBPeerError, PeerFault


class Gathering(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> list[list[int]]: ...


class Transport(Protocol):
    rank: int
    world_size: int

    def start(self, tag: tuple[int, ...], vector: Sequence[int]) -> Gathering: ...

    def exchange(
        self, tag: tuple[int, ...], ids: Sequence[int], what: str = "an exchange"
    ) -> list[list[int]]: ...


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

    def exchange(
        self, tag: tuple[int, ...], ids: Sequence[int], what: str = "an exchange"
    ) -> list[list[int]]:
        return [list(ids)]

    def reduce_max(self, data: bytes, what: str = "an all-reduce") -> bytes:
        return bytes(data)


class GlooTransport:
    """All-gather on a gloo group of all ranks of the default process group.

    Built in two phases: the constructor only reads the rank and world size;
    `connect(summary)` (called by the loader once its whole config is validated)
    meets every peer on the default store, compares the configs, and only then
    creates the gloo group. See `PeerBoard` for what else the store carries.
    """

    def __init__(self, peer_timeout: float) -> None:
        if not dist.is_gloo_available():
            raise ConfigError(
                "ODBDataLoader syncs ranks over a gloo process group, but this torch build "
                "has no gloo backend; cross-rank alignment cannot work here"
            )
        self.timeout = peer_timeout
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.seq = 0
        self.board: PeerBoard | None = None
        self.group: Any = None
        # The inodes of the group's sockets: forked DataLoader workers close them
        # (see source.WorkerGuard), so a dead rank's connections close with it.
        self.socket_inodes: frozenset[str] = frozenset()

    def connect(self, summary: Mapping[str, Any] | None = None, seq: int | None = None) -> None:
        if self.group is not None:
            return
        self.seq = next_loader_seq() if seq is None else seq
        store = _default_store()
        if store is not None:
            self.board = PeerBoard(store, self.seq, self.rank, self.world_size, self.timeout)
            try:
                self.board.rendezvous(dict(summary or {}))
            except (ConfigError, ODBPeerError):
                raise
            except RuntimeError as exc:  # DistNetworkError &c.: the store's host is gone
                raise _store_lost(self.rank, exc) from exc
        before = _socket_inodes()
        # A collective on the default group: every rank constructs its loader in the
        # same order, as it does for any process group.
        try:
            self.group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.timeout)
            )
        except RuntimeError as exc:
            raise self.peer_error(exc, "forming the loader's gloo group failed") from exc
        self.socket_inodes = frozenset(_socket_inodes() - before)
        if self.board is not None:
            self.board.start_watch()

    def start(self, tag: tuple[int, ...], vector: Sequence[int]) -> Gathering:
        self.connect()
        row = torch.tensor([*tag, *vector], dtype=torch.int64)
        out = [torch.empty_like(row) for _ in range(self.world_size)]
        try:
            work = dist.all_gather(out, row, group=self.group, async_op=True)
        except RuntimeError as exc:
            raise self.peer_error(
                exc, f"could not start the all-gather of round {tag[-1]}"
            ) from exc
        assert work is not None
        return _GlooGathering(self, work, out, tag)

    def exchange(
        self,
        tag: tuple[int, ...],
        ids: Sequence[int],
        what: str = "the ledger exchange at the close of the epoch",
    ) -> list[list[int]]:
        """Every rank's ids (the ledger, the ids held, a resume claim), in rank order.
        One all_gather_object on the gloo group, whose timeout is peer_timeout;
        `what` names the exchange in a peer error."""
        self.connect()
        out: list[object] = [None] * self.world_size
        try:
            dist.all_gather_object(out, (tag, list(ids)), group=self.group)
        except RuntimeError as exc:
            raise self.peer_error(exc, f"{what} did not complete") from exc
        rows: list[list[int]] = []
        for peer, got in enumerate(out):
            if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], list)):
                raise ODBPeerError(
                    f"rank {peer} sent a malformed ledger {got!r}",
                    ranks=(peer,),
                    cause=PeerFault.MISMATCH,
                )
            if tuple(got[0]) != tag:
                raise ODBPeerError(
                    f"rank {self.rank} closed the epoch with (config digest, order digest, "
                    f"iteration, round) = {tag} but rank {peer} with {tuple(got[0])}",
                    ranks=(peer,),
                    cause=PeerFault.MISMATCH,
                )
            rows.append(got[1])
        return rows

    def reduce_max(self, data: bytes, what: str = "an all-reduce") -> bytes:
        """The bytewise maximum of every rank's `data` (the same length on every
        rank): one all_reduce of a uint8 tensor on the gloo group, 2(W-1)/W x its
        length on the wire per rank (a ring), however many ranks."""
        self.connect()
        t = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.zeros(0, dtype=torch.uint8)
        )
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as exc:
            raise self.peer_error(exc, f"{what} did not complete") from exc
        return bytes(t.numpy().tobytes())

    # ---- failures ----------------------------------------------------------------

    def report(self, exc: BaseException) -> None:
        """Tell the peers this rank's loader failed (best effort, in the background)."""
        if self.board is not None:
            # A peer error this rank only relays names the ranks that failed before it,
            # so a reader can name those first (see PeerBoard.verdict).
            relayed = exc.ranks if isinstance(exc, ODBPeerError) else ()
            self.board.report(f"{type(exc).__name__}: {exc}", relayed)

    def flush(self, wait: float) -> None:
        """Wait (at most `wait` s) for the failure note to reach the store."""
        if self.board is not None:
            self.board.flush(wait)

    def verdict(self) -> ODBPeerError | None:
        """A peer failure known without a collective: a peer said it failed, or a
        peer's heartbeat stopped for longer than peer_timeout while this rank waits."""
        return None if self.board is None else self.board.verdict()

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        """Mark this rank as waiting on its peers (their heartbeats are read then)."""
        if self.board is None:
            return contextlib.nullcontext()
        return self.board.waiting()

    def peer_error(self, exc: BaseException, what: str) -> ODBPeerError:
        """An ODBPeerError for a failed gloo operation, naming the peer(s) and why."""
        if self.board is not None:
            self.board.refresh(wait=0.5)  # a peer that failed and left may have said why
        known = None if self.board is None else self.board.verdict(store_lost=False)
        if known is not None:
            return known
        text = str(exc)
        died = any(m in text.lower() for m in _CLOSED)
        probe = {} if self.board is None else self.board.probe()
        if died and self.board is not None:
            # A killed peer's sockets close before /proc shows its process gone (the
            # kernel closes its files first): look again, briefly, before naming no one.
            deadline = time.monotonic() + 1.0
            while probe and "gone" not in probe.values() and time.monotonic() < deadline:
                time.sleep(0.02)
                probe = self.board.probe()
        if died:
            ranks = tuple(r for r, st in probe.items() if st == "gone")
        else:
            ranks = tuple(r for r, st in probe.items() if st in ("gone", "stopped"))
        if not ranks and self.world_size == 2:
            ranks = (1 - self.rank,)
        who = _who(ranks)
        if died:
            cause = PeerFault.DIED
            why = f"{who} died: its connection was closed ({what})"
        else:
            cause = PeerFault.HUNG
            states = {probe.get(r) for r in ranks}
            how = (
                "its process is stopped"
                if states == {"stopped"}
                else "its process is gone"
                if states == {"gone"}
                else "it did not join (alive but stuck before the collective, e.g. in its "
                "data pipeline or training step, or on another host)"
            )
            why = f"{who} hung: {what} within peer_timeout={self.timeout:g}s; {how}"
        return ODBPeerError(f"rank {self.rank}: {why}: {text}", ranks=ranks, cause=cause)


def _parse_note(raw: str) -> tuple[tuple[int, ...], str]:
    """(ranks the note relays, its message) of a peer's failure note."""
    try:
        d = json.loads(raw)
        relayed = tuple(int(r) for r in d["relayed"])
        return relayed, str(d["message"])
    except (ValueError, KeyError, TypeError):
        return (), raw


def _first_failed(faults: Mapping[int, tuple[tuple[int, ...], str]], me: int) -> tuple[int, ...]:
    """The failed ranks, those that failed first ahead: a rank whose note relays
    another rank's failure comes after the ranks it names, which come first even if
    they left no note of their own (killed). A note that names the reader `me` (a
    peer gave up waiting on it) names no one first."""
    roots: list[int] = []
    for r in sorted(faults):
        if not faults[r][0]:
            roots.append(r)
    for r in sorted(faults):
        roots.extend(x for x in faults[r][0] if x not in roots and x not in faults and x != me)
    relays = [r for r in sorted(faults) if r not in roots]
    return tuple(roots + relays)


def _store_lost(rank: int, exc: BaseException) -> ODBPeerError:
    """The store died while this rank met its peers: under init_method tcp:// or env://
    its host is rank 0 (under torchrun, the agent)."""
    return ODBPeerError(
        f"rank {rank}: rank 0 died while the ranks constructed their ODBDataLoaders: the "
        f"rendezvous store it hosts (under tcp:// or env://; under torchrun, the agent "
        f"hosts it) is unreachable: {exc}",
        ranks=(0,) if rank != 0 else (),
        cause=PeerFault.DIED,
    )


def _who(ranks: tuple[int, ...]) -> str:
    if not ranks:
        return "a peer rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


_CLOSED = ("connection closed", "connection reset", "broken pipe", "closed by peer", "eof")


class _GlooGathering:
    def __init__(
        self, t: GlooTransport, work: dist.Work, out: list[torch.Tensor], tag: tuple[int, ...]
    ) -> None:
        self._t, self._work, self._out, self._tag = t, work, out, tag

    def done(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self) -> list[list[int]]:
        t = self._t
        what = f"no all-gather of round {self._tag[-1]}"
        deadline = time.monotonic() + t.timeout + 1.0
        step = datetime.timedelta(seconds=_poll_interval(t.timeout))
        with t.waiting():
            while True:
                try:
                    self._work.wait(timeout=step)
                    break
                except RuntimeError as exc:
                    if str(exc) != "Operation timed out!":
                        raise t.peer_error(exc, what) from exc
                    known = t.verdict()
                    if known is not None:
                        raise known from None
                    if time.monotonic() > deadline:  # gloo's own timeout did not fire
                        raise t.peer_error(exc, what) from exc
        rows: list[list[int]] = [o.tolist() for o in self._out]
        n = len(self._tag)
        for peer, row in enumerate(rows):
            if tuple(row[:n]) != self._tag:
                raise ODBPeerError(
                    f"rank {t.rank} sent (config digest, order digest, iteration, round) = "
                    f"{self._tag} but rank {peer} sent {tuple(row[:n])}: the ranks use "
                    "different loader configs, different sample orders (seed every rank's "
                    "sampler alike), or iterate the loader differently (every rank must run "
                    "the same epochs and stop at the same step)",
                    ranks=(peer,),
                    cause=PeerFault.MISMATCH,
                )
        return [row[n:] for row in rows]


# ---- the peer board: rendezvous, heartbeats and failure notes on the default store ----

_seq_lock = threading.Lock()
_seq = 0


def next_loader_seq() -> int:
    """The number of ODBDataLoaders this process has started to construct: every
    rank constructs its loaders in the same order, so it names the same loader."""
    global _seq
    with _seq_lock:
        _seq += 1
        return _seq


def _default_store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # not initialised, or a torch without it: no board
        return None


def _poll_interval(timeout: float) -> float:
    return min(1.0, max(0.05, timeout / 10))


def _socket_inodes() -> set[str]:
    out: set[str] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(link)
    return out


def _proc_start(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a local process, or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def announce_construction_error(seq: int, exc: BaseException) -> None:
    """A rank whose loader construction failed tells its peers (which wait for it in
    the rendezvous), so they raise a clear ConfigError instead of timing out."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    store = _default_store()
    if store is None:
        return
    board = PeerBoard(store, seq, dist.get_rank(), dist.get_world_size(), 1.0)
    board.post(f"err{board.rank}", f"{type(exc).__name__}: {exc}", "errors", wait=1.0)


class PeerBoard:
    """Keys `odb/<seq>/...` on the default store (the one init_process_group made):

    - `cfg<r>`: rank r's host, pid and config summary, posted at construction; every
      rank waits for all of them (polling, so a peer's `err<r>` ends the wait with a
      ConfigError naming it) and compares the configs before any group exists;
    - `hb<r>`: rank r's heartbeat (wall time, every `peer_timeout / 10` s, at most 1 s),
      read only while this rank waits on its peers: a stopped or dead peer is named
      `peer_timeout` after its last beat, however late this rank issued the round;
    - `fault<r>` + the counter `failed`: rank r's loader failed, and why.
    """

    def __init__(self, store: Any, seq: int, rank: int, world: int, timeout: float) -> None:
        self.store = dist.distributed_c10d.PrefixStore(f"odb/{seq}/", store)
        self.rank, self.world, self.timeout = rank, world, timeout
        self.interval = _poll_interval(timeout)
        self.peers: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._waiters = 0
        self._failed_seen = 0
        self._faults: dict[int, tuple[tuple[int, ...], str]] = {}  # rank -> (relayed, why)
        self._stale: dict[int, float] = {}
        self._store_lost: BaseException | None = None
        self._posting: threading.Thread | None = None
        self._thread: threading.Thread | None = None

    def post(
        self, key: str, value: str, counter: str | None = None, wait: float = 0.0
    ) -> threading.Thread:
        def send() -> None:
            with contextlib.suppress(Exception):
                self.store.set(key, value)
                if counter is not None:
                    self.store.add(counter, 1)

        th = _board_thread(send, "odb-board-post")
        if wait:
            th.join(wait)
        return th

    def rendezvous(self, summary: dict[str, Any]) -> None:
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": (_proc_start(os.getpid()) or ("", ""))[1],
            "config": summary,
        }
        self.store.set(f"cfg{self.rank}", json.dumps(me, default=str))
        keys = [f"cfg{r}" for r in range(self.world)]
        deadline = time.monotonic() + self.timeout
        while True:
            if int(self.store.add("errors", 0)):
                for r in range(self.world):
                    if self.store.check([f"err{r}"]):
                        msg = self.store.get(f"err{r}").decode(errors="replace")
                        raise ConfigError(
                            f"rank {r} could not construct its ODBDataLoader ({msg}); rank "
                            f"{self.rank} stops too, before creating any process group"
                        )
            if self.store.check(keys):
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world) if not self.store.check([keys[r]])]
                raise ODBPeerError(
                    f"rank {self.rank}: {_who(tuple(missing))} did not construct "
                    f"{'its' if len(missing) == 1 else 'their'} ODBDataLoader within "
                    f"peer_timeout={self.timeout:g}s (gone, or stuck before it)",
                    ranks=tuple(missing),
                    cause=PeerFault.HUNG,
                )
            time.sleep(0.05)
        for r, raw in enumerate(self.store.multi_get(keys)):
            self.peers[r] = json.loads(raw.decode())
        mine = self.peers[self.rank]["config"]
        for r, info in self.peers.items():
            theirs = info["config"]
            diff = [
                f"{k}: {mine.get(k)!r} here, {theirs.get(k)!r} on rank {r}"
                for k in sorted(set(mine) | set(theirs))
                if mine.get(k) != theirs.get(k)
            ]
            if diff:
                raise ConfigError(
                    f"rank {self.rank} and rank {r} built ODBDataLoaders with different "
                    "configs (every rank must pass the same arguments): " + "; ".join(diff)
                )

    def start_watch(self) -> None:
        if self._thread is None:
            ref, interval = weakref.ref(self), self.interval  # no strong ref: GC ends it
            self._thread = _board_thread(lambda: _watch(ref, interval), "odb-heartbeat")

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        with self._lock:
            self._waiters += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1
                if not self._waiters:
                    self._stale = {}

    def report(self, message: str, relayed: tuple[int, ...] = ()) -> None:
        note = json.dumps({"relayed": list(relayed), "message": message[:4000]})
        self._posting = self.post(f"fault{self.rank}", note, "failed")

    def flush(self, wait: float) -> None:
        if self._posting is not None:
            self._posting.join(wait)

    def refresh(self, wait: float) -> None:
        """Read the peers' failure notes now (at most `wait` seconds)."""
        _board_thread(self._read_faults, "odb-board-read").join(wait)

    def verdict(self, store_lost: bool = True) -> ODBPeerError | None:
        with self._lock:
            faults, stale = dict(self._faults), dict(self._stale)
            lost = self._store_lost if store_lost else None
        if faults:
            ranks = _first_failed(faults, self.rank)
            detail = "; ".join(f"rank {r}: {faults[r][1]}" for r in ranks if r in faults)
            then = f" (then {_who(ranks[1:])})" if len(ranks) > 1 else ""
            return ODBPeerError(
                f"rank {self.rank}: {_who(ranks[:1])} failed{then} and left: {detail}",
                ranks=ranks,
                cause=PeerFault.FAILED,
            )
        if lost is not None:
            gone = tuple(r for r, st in self.probe().items() if st == "gone")
            return ODBPeerError(
                f"rank {self.rank}: the rendezvous store is unreachable, so its host is gone "
                f"(rank 0 under init_method tcp:// or env://, or the launcher)"
                + (f"; {_who(gone)} died" if gone else "")
                + f": {lost}",
                ranks=gone,
                cause=PeerFault.DIED,
            )
        if stale:
            ranks = tuple(sorted(stale))
            probe = self.probe()
            states = {probe.get(r) for r in ranks}
            died = states == {"gone"}
            how = (
                "its process is gone"
                if died
                else "its process is stopped"
                if states == {"stopped"}
                else "its process does not run (stopped, frozen or gone)"
            )
            age = max(stale.values())
            return ODBPeerError(
                f"rank {self.rank}: {_who(ranks)} "
                f"{'died' if died else 'hung'}: no heartbeat for {age:.1f}s "
                f"(> peer_timeout={self.timeout:g}s); {how}",
                ranks=ranks,
                cause=PeerFault.DIED if died else PeerFault.HUNG,
            )
        return None

    def _read_faults(self) -> None:
        s = self.store
        with contextlib.suppress(Exception):
            failed = int(s.add("failed", 0))
            if failed > self._failed_seen:
                for r in range(self.world):
                    if r != self.rank and r not in self._faults and s.check([f"fault{r}"]):
                        note = _parse_note(s.get(f"fault{r}").decode(errors="replace"))
                        with self._lock:
                            self._faults[r] = note
                self._failed_seen = failed

    def probe(self) -> dict[int, str]:
        """The state of each peer process on this host: gone, stopped or running."""
        host = socket.gethostname()
        out: dict[int, str] = {}
        for r, info in self.peers.items():
            if r == self.rank or info.get("host") != host:
                continue
            st = _proc_start(int(info["pid"]))
            if st is None or st[0] in ("Z", "X") or st[1] != info.get("start"):
                out[r] = "gone"
            elif st[0] in ("T", "t"):
                out[r] = "stopped"
            else:
                out[r] = "running"
        return out

    def beat(self) -> None:
        """One heartbeat, and the reads that go with it."""
        s = self.store
        s.set(f"hb{self.rank}", f"{time.time():.3f}")
        self._read_faults()
        with self._lock:
            waiting = self._waiters > 0
        if not waiting:
            return
        peers = [r for r in range(self.world) if r != self.rank]
        keys = [f"hb{r}" for r in peers]
        if not s.check(keys):
            return
        now = time.time()
        stale = {}
        for r, raw in zip(peers, s.multi_get(keys), strict=True):
            age = now - float(raw.decode())
            if age > self.timeout:
                stale[r] = age
        with self._lock:
            if self._waiters:
                self._stale = stale


def _watch(ref: weakref.ref[PeerBoard], interval: float) -> None:
    while not _exiting.is_set():
        board = ref()
        if board is None:
            return
        try:
            board.beat()
        except Exception as exc:  # the store is gone: its host died
            with board._lock:
                board._store_lost = exc
            return
        del board
        _exiting.wait(interval)


# Threads that call the store (heartbeat, posts, reads) are daemons, so a rank
# whose peers or store hang can still exit. But a store call releases the GIL in
# C++ (pybind11's gil_scoped_release); a daemon thread that returns from it after
# interpreter finalization began is ended by CPython with pthread_exit, whose
# forced unwind runs through the (noexcept) ~gil_scoped_release: std::terminate,
# "terminate called without an active exception", SIGABRT after a finished job
# (issue 31, docs/ELASTIC.md). So they stop and are joined at exit, before
# finalization: atexit runs before it, and this hook, registered after torch's
# import, before torch's own hooks.
_exiting = threading.Event()
_store_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
EXIT_JOIN_S = 10.0  # a healthy store answers in ms; a dead one would hold exit for its timeout


def _board_thread(target: Callable[[], None], name: str) -> threading.Thread:
    th = threading.Thread(target=target, name=name, daemon=True)
    _store_threads.add(th)
    th.start()
    return th


def stop_store_threads(wait: float = EXIT_JOIN_S) -> None:
    """Stop the heartbeats and join every thread still inside a store call (at
    most `wait` seconds in all). Runs at interpreter exit; no user call needed."""
    _exiting.set()
    deadline = time.monotonic() + wait
    for th in list(_store_threads):
        if th is not threading.current_thread():
            th.join(max(0.0, deadline - time.monotonic()))


atexit.register(stop_store_threads)
