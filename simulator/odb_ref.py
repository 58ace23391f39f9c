"""`odb-ref`: the PyPI package `online-dynamic-batching` (import `odb`) as a comparator.

Nothing of that package is copied here. Its public grouping function
`odb.grouping.grouping_data` is called unchanged, once per rank per round, from
one thread per rank; its single `torch.distributed.all_gather_into_tensor` is
served by an in-process exchange (a barrier), so W ranks run in one process.
The driver loop below is ours: it feeds each rank's stream of samples to that
function the way the package's documentation describes its collate loop
(collect `buffer_size` samples, warm-up ramp, overflow recycled into the next
buffer, `is_finished` once the source is dry, join mode), and the trainer runs
the groups each rank emits. In join mode a rank with fewer groups than its peers
in a round shadows the missing steps (DDP Join): those count as pad steps here.
"""

from __future__ import annotations

import importlib
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from simulator.slots import Columns, make_slot, mark_aborted

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from simulator.dataloader import DataSource
    from simulator.trainer import Slot, Trainer

MAX_REF_RANKS = 64
_WARMUP_STEP = 0.05  # the package's documented warm-up ramp of the buffer threshold


def unavailable(world: int) -> str | None:
    """None if odb-ref can run, else the reason it is skipped."""
    if world > MAX_REF_RANKS:
        return f"skipped: odb-ref runs one thread per rank; limited to {MAX_REF_RANKS} ranks"
    try:
        importlib.import_module("odb.grouping")
    except Exception as exc:
        return (
            "skipped: the PyPI package online-dynamic-batching (import odb) is not importable "
            f"({type(exc).__name__}: {exc}); `pip install online-dynamic-batching` to compare"
        )
    return None


class _Ids(tuple):  # type: ignore[type-arg]
    """A stand-in for `input_ids` that only reports its length."""

    n: int

    def __new__(cls, n: int) -> _Ids:
        obj = super().__new__(cls)
        obj.n = n
        return obj

    def __len__(self) -> int:
        return self.n


class _Group:
    def __init__(self, rank: int) -> None:
        self.rank = rank


class _Exchange:
    """Serves `dist.get_world_size / get_rank / all_gather_into_tensor` for W threads."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[Any] = [None] * world

    def get_world_size(self, group: _Group) -> int:
        return self.world

    def get_rank(self, group: _Group) -> int:
        return group.rank

    def all_gather_into_tensor(self, out: Any, inp: Any, group: _Group) -> None:
        import torch

        self.slots[group.rank] = inp.clone()
        self.barrier.wait()
        out.copy_(torch.cat(self.slots))
        self.barrier.wait()


@contextmanager
def _patched_dist(exchange: _Exchange) -> Iterator[Any]:
    grouping = importlib.import_module("odb.grouping")
    saved = getattr(grouping, "dist")  # noqa: B009 - a third-party module attribute
    setattr(grouping, "dist", exchange)  # noqa: B010
    try:
        yield getattr(grouping, "grouping_data")  # noqa: B009
    finally:
        setattr(grouping, "dist", saved)  # noqa: B010


class _RankState:
    def __init__(self) -> None:
        self.data_buffer: list[list[dict[str, Any]]] = []
        self.idx_count = 0
        self.finished = False
        self.counter = 0.0
        self.clock = 0.0


def _invoke(job: tuple[Any, int, int, int, list[list[dict[str, Any]]], bool, int]) -> Any:
    grouping_data, budget, max_groups, rank, buf, fin, idx_budget = job
    return grouping_data(
        buf,
        budget,
        _Group(rank),
        is_finished=fin,
        idx_budget=idx_budget,
        join_mode=True,
        max_groups=max_groups,
    )


class RunContext(Protocol):
    """What this comparator needs from the engine's run (the engine implements it;
    typed here so that this module never imports the engine)."""

    cfg: Any
    world: int
    cols: Columns
    perm: list[int]
    budget: int
    events: int
    pad_slot: Slot
    progress: Callable[[int], None] | None

    def trainer(self, budget: float) -> Trainer: ...
    def source(self, r: int, order: Sequence[int], depth: int) -> DataSource: ...
    def cost_of(self, ids: Sequence[int], cached: bool = False) -> float: ...
    def visual_of(self, ids: Sequence[int]) -> int: ...
    def ddp_fault(self, tr: Trainer) -> dict[str, Any] | None: ...


def run(run: RunContext) -> dict[str, Any]:
    cfg, w, cols = run.cfg, run.world, run.cols
    shards = [run.perm[r::w] for r in range(w)]
    depth = max(cfg.prefetch_factor * cfg.num_workers, cfg.buffer_size)
    sources = [run.source(r, shards[r], depth) for r in range(w)]
    states = [_RankState() for _ in range(w)]
    tr = run.trainer(run.budget)
    padded = cfg.padded_collation
    gather_s = cfg.hardware.network.allgather_s(w, 8 * (2 + cfg.buffer_size))
    budget = int(run.budget)
    exchange = _Exchange(w)
    gate = 0.0
    rounds = 0
    all_finished = False
    max_rounds = 4 * cols.n + 16
    with _patched_dist(exchange) as grouping_data, ThreadPoolExecutor(max_workers=w) as pool:
        while not all_finished and rounds < max_rounds:
            calls: list[tuple[list[list[dict[str, Any]]], bool, int]] = []
            times: list[float] = []
            for r in range(w):
                st, src = states[r], sources[r]
                t = st.clock
                is_finished = st.finished
                if not st.finished:
                    threshold = int(cfg.buffer_size * st.counter)
                    while st.idx_count < max(1, threshold) and not src.dry:
                        idx, t = src.pull(t)
                        st.data_buffer.append([{"input_ids": _Ids(cols.length[idx]), "_id": idx}])
                        st.idx_count += 1
                        run.events += 1
                    if src.dry and st.idx_count == 0:
                        st.finished = is_finished = True
                        t = max(t, src.dry_at())
                calls.append((st.data_buffer, is_finished, st.idx_count))
                times.append(max(t, gate))

            jobs = [(grouping_data, budget, cfg.buffer_size, r, *calls[r]) for r in range(w)]
            outs = list(pool.map(_invoke, jobs))
            rounds += 1
            t_g = max(times) + gather_s
            emitted: list[list[list[dict[str, Any]]]] = []
            for r in range(w):
                grouped, overflow, fin_all, skip = outs[r]
                st = states[r]
                _, is_finished, idx_budget = calls[r]
                st.data_buffer = [[s] for s in overflow]
                st.counter = min(1.0, st.counter + _WARMUP_STEP) if not is_finished else st.counter
                groups: list[list[dict[str, Any]]] = []
                if not skip and not (is_finished and idx_budget == 0):
                    groups = [g for g in grouped if g][: max(idx_budget, 0)]
                st.idx_count = 0
                st.clock = t_g
                emitted.append(groups)
                all_finished = bool(fin_all)
            k = max(len(g) for g in emitted)
            first_start: float | None = None
            for t_idx in range(k):
                slots = []
                for r in range(w):
                    if t_idx < len(emitted[r]):
                        ids = tuple(int(s["_id"]) for s in emitted[r][t_idx])
                        lens = [cols.length[i] for i in ids]
                        slots.append(
                            make_slot(lens, ids, padded, run.cost_of(ids), run.visual_of(ids))
                        )
                    else:
                        slots.append(run.pad_slot)
                prev_end = tr.end
                if not tr.step(t_g, slots):
                    break
                if first_start is None:
                    first_start = max(t_g, prev_end)
                if run.progress is not None:
                    run.progress(sum(len(s.ids) for s in slots))
            if tr.halted:
                break
            gate = first_start if first_start is not None else t_g
    out = tr.metrics()
    leftover = sum(len(b) for st in states for b in st.data_buffer)
    out.update({"rounds": rounds, "left_in_buffers": leftover, "violations": []})
    out["timeline"] = tr.timeline()
    out["fault"] = run.ddp_fault(tr) if cfg.faults.dead_rank is not None else None
    mark_aborted(out)
    return {"metrics": out, "trainer": tr}
