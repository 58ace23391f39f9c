"""The discrete-event simulation of one epoch under each batching strategy.

Time advances per rank (DataLoader workers, batcher) and globally (DDP steps and
collectives, which synchronise all ranks). For `odb*` every batching decision is
made by `odb_core.protocol.RankMachine`, one per rank, driven through its
observe / exhaust / form / contribute / all_gather events; the round semantics
are the core's `decide_round`, reached through `RankMachine.all_gather`. Pad
steps, step counts, lost and duplicated ids are read from what the machines
emit. `standard`, `gmt` and `bmt` are baselines implemented here (they are not
the protocol); `odb-ref` drives the PyPI package `online-dynamic-batching`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from odb_core.assign import dynamic_bounds
from odb_core.config import (
    Mode,
    OversizePolicy,
    ProtocolConfig,
    Sharding,
    coerce_enum,
    make_cost_model,
)
from odb_core.cost import BatchStats, Budget, CostKind, CostModel
from odb_core.cost_table import CostTable, record
from odb_core.errors import ConfigError, ODBPeerError
from odb_core.formers import FormerKind
from odb_core.protocol import (
    Contribution,
    RankAction,
    RankMachine,
    StepInfo,
    rounds_bound,
    steps_bound,
)
from odb_core.sample import Sample
from simulator import grouped
from simulator.hardware import HardwareModel
from simulator.pipeline import DataSource
from simulator.slots import Columns, make_slot, mark_aborted
from simulator.trainer import Slot, Trainer
from simulator.workloads import Workload

STRATEGIES: dict[str, str] = {
    "standard": "fixed batch size per rank, padded (DistributedSampler order)",
    "gmt": "offline Global Max Tokens oracle: sort by cached length, cut at budget, shard",
    "bmt": "offline Bucketed Max Tokens: sorted mega-buckets, packed at budget, shard",
    "grouped": "HF Trainer group_by_length: LengthGroupedSampler, Accelerate-sharded, padded",
    "grouped-modality": "LLaVA group_by_modality_length sampler, Accelerate-sharded, padded",
    "odb": "odb_core protocol, join mode, sort-window greedy former (or --former)",
    "odb-bfd": "odb_core protocol, join mode, best-fit-decreasing former",
    "odb-quota": "odb_core protocol, quota mode (first rank dry closes), odb's former",
    "odb-ref": "PyPI online-dynamic-batching grouping on the same stream (if installed)",
}
DEFAULT_STRATEGIES = tuple(STRATEGIES)
#: The cost models the simulator times (its collation knows padded and packed rows).
COSTS = (CostKind.PACKED, CostKind.PADDED, CostKind.ATTENTION)
# Fixed-size batches are padded whatever the cost model (a DataLoader's default collation).
_FIXED_BATCH = frozenset({"standard", "grouped", "grouped-modality"})

# Host-side cost of the batcher per formed window sample (sorting, bookkeeping).
FORM_S_PER_SAMPLE = 2e-6


@dataclass(frozen=True)
class Faults:
    """Optional faults. Ranks and workers are 0-based."""

    stragglers: tuple[tuple[int, float], ...] = ()  # (rank, compute slowdown factor)
    stalls: tuple[tuple[int, int, float, float], ...] = ()  # (rank, worker, at_s, duration_s)
    slow_collective_prob: float = 0.0
    slow_collective_factor: float = 10.0
    dead_rank: int | None = None
    dead_at_s: float = 0.0

    def validate(self, world: int) -> None:
        for r, f in self.stragglers:
            _check_rank("straggler", r, world)
            if not (math.isfinite(f) and f >= 1):
                raise ConfigError(f"straggler factor {f!r} for rank {r} must be >= 1")
        for r, w, at, dur in self.stalls:
            _check_rank("stall", r, world)
            if w < 0 or not (math.isfinite(at) and at >= 0 and math.isfinite(dur) and dur > 0):
                raise ConfigError(f"stall {(r, w, at, dur)!r}: need worker>=0, at>=0, duration>0")
        if not 0 <= self.slow_collective_prob <= 1:
            raise ConfigError(
                f"slow collective probability {self.slow_collective_prob!r} not in [0,1]"
            )
        if not (math.isfinite(self.slow_collective_factor) and self.slow_collective_factor >= 1):
            raise ConfigError(
                f"slow collective factor {self.slow_collective_factor!r} must be >= 1"
            )
        if self.dead_rank is not None:
            _check_rank("dead", self.dead_rank, world)
            if not (math.isfinite(self.dead_at_s) and self.dead_at_s >= 0):
                raise ConfigError(f"death time {self.dead_at_s!r} must be >= 0")

    def describe(self) -> dict[str, Any]:
        return {
            "stragglers": [list(x) for x in self.stragglers],
            "stalls": [list(x) for x in self.stalls],
            "slow_collective_prob": self.slow_collective_prob,
            "slow_collective_factor": self.slow_collective_factor,
            "dead_rank": self.dead_rank,
            "dead_at_s": self.dead_at_s if self.dead_rank is not None else None,
        }


def _check_rank(what: str, r: int, world: int) -> None:
    if not 0 <= r < world:
        raise ConfigError(f"{what} rank {r!r} is not in [0, {world})")


@dataclass(frozen=True)
class SimConfig:
    workload: Workload
    ranks: int
    hardware: HardwareModel
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    seed: int = 0
    budget: int | None = None
    batch_size: int | None = None
    cost: CostKind = CostKind.PACKED  # or its value, e.g. "padded"
    attention_alpha: float = 1.0 / 4096
    buffer_size: int = 64
    former: FormerKind = FormerKind.SORT_WINDOW_GREEDY
    max_steps_per_round: int = 8
    quota: int | None = None
    oversize: OversizePolicy = OversizePolicy.SOLO
    num_workers: int = 4
    prefetch_factor: int = 2
    bmt_bucket: int = 4096
    peer_timeout_s: float = 60.0
    faults: Faults = field(default_factory=Faults)
    tail_window: int = 12
    sharding: Sharding | None = None
    """odb's sharding; None: dynamic, as the loader's default, but static with
    `early_form` (static-only) or the padded cost (a deal target below the window
    pads more), as in the loader."""
    early_form: int | None = None
    """odb (join mode): `ProtocolConfig.early_form`, the least partial window a rank
    forms early; None: off."""
    epochs: int = 1
    """Epochs run in a row; from the second on, odb's deals are priced by the costs
    its ranks observed in the one before (`odb_core.cost_table`), and every sample's
    cost varies from epoch to epoch by `epoch_noise` (augmentation)."""
    epoch_noise: float = 0.1
    cost_table: bool = True
    """From the second epoch, price odb's deals by the costs learned in the one
    before; False: at the mean, as in the first (the control of the table's gain)."""
    """The relative spread (log-normal sigma) of a sample's cost between epochs."""
    early_form_wait_s: float = 0.25
    """A rank forms early only if its next sample is not there yet and the rest of
    its window would take longer than this to preprocess."""

    def __post_init__(self) -> None:
        for name in ("ranks", "buffer_size", "max_steps_per_round", "num_workers", "epochs"):
            _positive(name, getattr(self, name))
        _positive("prefetch_factor", self.prefetch_factor)
        _positive("bmt_bucket", self.bmt_bucket)
        if self.budget is not None:
            _positive("budget", self.budget)
        if self.batch_size is not None:
            _positive("batch size", self.batch_size)
        if self.quota is not None:
            _positive("quota", self.quota)
        if self.early_form is not None:
            _positive("early_form", self.early_form)
        if not (math.isfinite(self.early_form_wait_s) and self.early_form_wait_s >= 0):
            raise ConfigError(f"early form wait {self.early_form_wait_s!r} must be >= 0 seconds")
        if not (math.isfinite(self.epoch_noise) and self.epoch_noise >= 0):
            raise ConfigError(f"epoch noise {self.epoch_noise!r} must be >= 0")
        if not (math.isfinite(self.peer_timeout_s) and self.peer_timeout_s > 0):
            raise ConfigError(f"peer timeout {self.peer_timeout_s!r} must be > 0")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ConfigError(
                f"unknown strategy {unknown[0]!r}; expected one of {', '.join(STRATEGIES)}"
            )
        if not self.strategies:
            raise ConfigError("no strategy selected")
        cost = coerce_enum(CostKind, "cost model", self.cost)
        if cost not in COSTS:
            raise ConfigError(
                f"cost model {cost.value!r} is not simulated; expected one of "
                + ", ".join(repr(c.value) for c in COSTS)
            )
        object.__setattr__(self, "cost", cost)
        object.__setattr__(self, "former", coerce_enum(FormerKind, "former", self.former))
        sharding = self.sharding
        if sharding is None:  # the loader's default (odb_core.torch.options)
            static = self.early_form is not None or cost is CostKind.PADDED
            sharding = Sharding.STATIC if static else Sharding.DYNAMIC
        object.__setattr__(self, "sharding", coerce_enum(Sharding, "sharding", sharding))
        if not isinstance(self.oversize, OversizePolicy):
            object.__setattr__(self, "oversize", OversizePolicy(self.oversize))
        self.faults.validate(self.ranks)
        for r, w, _, _ in self.faults.stalls:
            if w >= self.num_workers:
                raise ConfigError(
                    f"stall worker {w} on rank {r} does not exist ({self.num_workers} workers)"
                )
        if self.oversize is OversizePolicy.ERROR:
            self._check_error_policy()

    def _check_error_policy(self) -> None:
        budget, model = Budget(self.token_budget), self.cost_model()
        lengths = self.workload.length
        smallest = int(lengths.min())
        if not budget.fits_alone(Sample(0, smallest), model):
            raise ConfigError(
                f"budget {self.token_budget} is smaller than the smallest sample "
                f"({smallest} tokens) under the 'error' oversize policy"
            )
        i = int(lengths.argmax())
        big = Sample(i, int(self.workload.text[i]), int(self.workload.visual[i]))
        if not budget.fits_alone(big, model):
            raise ConfigError(
                f"budget {self.token_budget} is smaller than sample {i} ({big.length} tokens) "
                "under the 'error' oversize policy; use --oversize solo or truncate"
            )

    @property
    def token_budget(self) -> int:
        return self.budget if self.budget is not None else self.hardware.default_budget()

    @property
    def standard_batch_size(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return max(1, self.hardware.token_capacity // int(self.workload.length.max()))

    def cost_model(self) -> CostModel:
        return make_cost_model(self.cost, alpha=self.attention_alpha)

    @property
    def padded_collation(self) -> bool:
        return self.cost is CostKind.PADDED

    @property
    def sharding_in_force(self) -> Sharding:
        """`sharding` as resolved by `__post_init__` (never None after it)."""
        assert self.sharding is not None
        return self.sharding

    def describe(self) -> dict[str, Any]:
        return {
            "workload": self.workload.name,
            "samples": self.workload.n,
            "ranks": self.ranks,
            "nodes": self.hardware.network.nodes,
            "seed": self.seed,
            "budget_tokens": self.token_budget,
            "standard_batch_size": self.standard_batch_size,
            "cost_model": self.cost.value,
            "buffer_size": self.buffer_size,
            "former": self.former.value,
            "sharding": self.sharding_in_force.value,
            "max_steps_per_round": self.max_steps_per_round,
            "quota": self.quota,
            "oversize": self.oversize.value,
            "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor,
            "bmt_bucket": self.bmt_bucket,
            "peer_timeout_s": self.peer_timeout_s,
            "strategies": list(self.strategies),
            "faults": self.faults.describe(),
            **(
                {"early_form": self.early_form, "early_form_wait_s": self.early_form_wait_s}
                if self.early_form is not None
                else {}
            ),
        }


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")


Progress = Callable[[int], None]


class _Run:
    """State shared by the strategy runners of one simulation."""

    def __init__(
        self,
        cfg: SimConfig,
        progress: Progress | None,
        epoch: int = 0,
        cost_table: CostTable | None = None,
    ) -> None:
        self.cfg = cfg
        self.cols = Columns(cfg.workload)
        self.world = cfg.ranks
        self.progress = progress
        self.budget = cfg.token_budget
        self.model = cfg.cost_model()
        self.cost_table = cost_table  # odb: the deal's prices (learned last epoch)
        self.learned: CostTable | None = None  # odb: the table this epoch observed
        rng = np.random.default_rng([cfg.seed, 1] if epoch == 0 else [cfg.seed, 1, epoch])
        self.perm: list[int] = rng.permutation(self.cols.n).tolist()
        pad_len = min(self.cols.length)
        self.pad_slot = Slot((), 0, pad_len, pad_len * pad_len, pad_len, 0.0, True)
        self.stalls: dict[int, list[tuple[int, float, float]]] = {}
        for r, w, at, dur in cfg.faults.stalls:
            self.stalls.setdefault(r, []).append((w, at, dur))
        self.events = 0

    def trainer(self, budget: float) -> Trainer:
        f = self.cfg.faults
        return Trainer(
            self.cfg.hardware,
            self.world,
            budget,
            self.pad_slot,
            stragglers=dict(f.stragglers),
            tail_window=self.cfg.tail_window,
            n_samples=self.cols.n,
            stop_at=f.dead_at_s if f.dead_rank is not None else float("inf"),
        )

    def source(self, r: int, order: Sequence[int], depth: int) -> DataSource:
        return DataSource(
            order, self.cols.prep, self.cfg.num_workers, depth, stalls=self.stalls.get(r, ())
        )

    def visual_of(self, ids: Sequence[int]) -> int:
        return sum(self.cols.visual[i] for i in ids)

    def cost_of(self, ids: Sequence[int], cached: bool = False) -> float:
        st = BatchStats()
        c = self.cols
        for i in ids:
            if cached:
                ln = c.cached[i]
                frac = c.text[i] / c.length[i] if c.length[i] else 1.0
                t = round(ln * frac)
                st = st.add(Sample(i, t, ln - t, c.patches[i]))
            else:
                st = st.add(Sample(i, c.text[i], c.visual[i], c.patches[i]))
        return self.model.cost(st)

    # ---- baselines -------------------------------------------------------

    def run_planned(self, name: str, plan: list[list[list[int]]], budget: float) -> dict[str, Any]:
        """Run per-rank batch lists (plan[r][s] = ids of rank r's s-th batch; an empty
        list is an idle step) with the DataLoader prefetching whole batches."""
        cfg = self.cfg
        padded = name in _FIXED_BATCH or cfg.padded_collation
        tr = self.trainer(budget)
        steps = max((len(p) for p in plan), default=0)
        sources = [
            self.source(r, [i for b in plan[r] for i in b], 1 << 60) for r in range(self.world)
        ]
        pb = cfg.prefetch_factor * cfg.num_workers
        starts: list[float] = []
        length = self.cols.length
        for s in range(steps):
            request = starts[s - pb] if s >= pb else 0.0
            ready = 0.0
            slots: list[Slot] = []
            for r in range(self.world):
                batch = plan[r][s] if s < len(plan[r]) else []
                if not batch:
                    slots.append(self.pad_slot)
                    continue
                t = request
                src = sources[r]
                for _ in batch:
                    _, t = src.pull(request, request)
                if t > ready:
                    ready = t
                lens = [length[i] for i in batch]
                slots.append(
                    make_slot(
                        lens, tuple(batch), padded, self.cost_of(batch), self.visual_of(batch)
                    )
                )
                self.events += len(batch)
            prev_end = tr.end
            if not tr.step(ready, slots):
                break
            starts.append(max(ready, prev_end))
            if self.progress is not None:
                self.progress(sum(len(x.ids) for x in slots))
        out = tr.metrics()
        out["timeline"] = tr.timeline()
        out["fault"] = self.ddp_fault(tr)
        mark_aborted(out)
        return {"metrics": out, "trainer": tr}

    def ddp_fault(self, tr: Trainer) -> dict[str, Any] | None:
        f = self.cfg.faults
        if f.dead_rank is None:
            return None
        at = max(tr.end, f.dead_at_s)
        timeout = self.cfg.hardware.network.collective_timeout_s
        return {
            "dead_rank": f.dead_rank,
            "died_at_s": f.dead_at_s,
            "detected_by": [r for r in range(self.world) if r != f.dead_rank],
            "detected_at_s": round(at + timeout, 3) if tr.halted else None,
            "how": "DDP gradient all-reduce hangs until the NCCL collective timeout",
            "epoch_completed": not tr.halted,
        }

    def standard(self) -> dict[str, Any]:
        bs = self.cfg.standard_batch_size
        n, w = self.cols.n, self.world
        order = self.perm + self.perm[: (-n) % w]  # DistributedSampler pads by repeating
        plan = []
        for r in range(w):
            shard = order[r::w]
            plan.append([shard[i : i + bs] for i in range(0, len(shard), bs)])
        return self.run_planned("standard", plan, float(self.budget))

    def _permute(self, salt: int) -> grouped.Permute:
        rng = np.random.default_rng([self.cfg.seed, salt])
        return lambda n: rng.permutation(n).tolist()

    def grouped(self) -> dict[str, Any]:
        """HF `group_by_length`: the sampler batch is the per-device batch (no gradient
        accumulation), the lengths are what a length column holds (cached lengths)."""
        bs, c = self.cfg.standard_batch_size, self.cols
        order = grouped.length_grouped_indices(c.cached, bs, self._permute(5)(c.n))
        plan = grouped.accelerate_shard(order, bs, self.world)
        return self.run_planned("grouped", plan, float(self.budget))

    def grouped_modality(self) -> dict[str, Any]:
        """LLaVA `group_by_modality_length` with `world_size = W` (no accumulation)."""
        bs, c = self.cfg.standard_batch_size, self.cols
        multimodal = [v > 0 for v in c.visual]
        order = grouped.modality_grouped_indices(
            c.cached, multimodal, bs, self.world, self._permute(6)
        )
        plan = grouped.accelerate_shard(order, bs, self.world)
        return self.run_planned("grouped-modality", plan, float(self.budget))

    def _cut(self, ordered: Sequence[int]) -> list[list[int]]:
        """Greedy cut of `ordered` at the budget, on cached lengths (what an offline
        sampler knows)."""
        batches: list[list[int]] = []
        cur: list[int] = []
        st = BatchStats()
        c = self.cols
        cost, budget = self.model.cost, self.budget
        for i in ordered:
            ln = c.cached[i]
            t = round(ln * c.text[i] / c.length[i]) if c.length[i] else ln
            nxt = st.add(Sample(i, t, ln - t, c.patches[i]))
            if cur and cost(nxt) > budget:
                batches.append(cur)
                cur, st = [i], BatchStats().add(Sample(i, t, ln - t, c.patches[i]))
            else:
                cur.append(i)
                st = nxt
        if cur:
            batches.append(cur)
        return batches

    def _shard_batches(self, batches: list[list[int]], salt: int) -> list[list[list[int]]]:
        rng = np.random.default_rng([self.cfg.seed, salt])
        order = rng.permutation(len(batches)).tolist()
        plan: list[list[list[int]]] = [[] for _ in range(self.world)]
        for k, b in enumerate(order):
            plan[k % self.world].append(batches[b])
        steps = max(len(p) for p in plan)
        for p in plan:
            p.extend([] for _ in range(steps - len(p)))  # idle (pad) steps at the end
        return plan

    def gmt(self) -> dict[str, Any]:
        c = self.cols
        ordered = sorted(range(c.n), key=lambda i: (-c.cached[i], i))
        return self.run_planned("gmt", self._shard_batches(self._cut(ordered), 2), self.budget)

    def bmt(self) -> dict[str, Any]:
        c, size = self.cols, self.cfg.bmt_bucket
        batches: list[list[int]] = []
        for k in range(0, c.n, size):
            bucket = sorted(self.perm[k : k + size], key=lambda i: (-c.cached[i], i))
            batches.extend(self._cut(bucket))
        return self.run_planned("bmt", self._shard_batches(batches, 3), self.budget)

    # ---- odb (the protocol) ------------------------------------------------

    def odb(self, former: FormerKind, mode: Mode) -> dict[str, Any]:
        cfg, w, cols = self.cfg, self.world, self.cols
        protocol = ProtocolConfig(
            world_size=w,
            budget=Budget(self.budget),
            cost_model=self.model,
            buffer_size=cfg.buffer_size,
            mode=mode,
            former=former,
            oversize=cfg.oversize,
            max_steps_per_round=cfg.max_steps_per_round,
            quota=cfg.quota if mode is Mode.QUOTA else None,
            sharding=cfg.sharding_in_force,
            plan=tuple(self.perm) if cfg.sharding_in_force is Sharding.DYNAMIC else (),
            cost_table=self.cost_table if cfg.sharding_in_force is Sharding.DYNAMIC else None,
            early_form=cfg.early_form if mode is Mode.JOIN else None,
        )
        dynamic = protocol.dynamic
        machines = [RankMachine(r, protocol) for r in range(w)]
        # Static: rank r reads its fixed shard. Dynamic: rank r reads the ids the core
        # deals it, in order; a worker starts an id no earlier than its deal.
        shards = [list(m.queue) if dynamic else self.perm[r::w] for r, m in enumerate(machines)]
        dealt_at = [[0.0] * len(s) for s in shards]
        depth = max(cfg.prefetch_factor * cfg.num_workers, cfg.buffer_size)
        sources = [self.source(r, shards[r], depth) for r in range(w)]

        def dealt(r: int) -> float:
            src = sources[r]
            return dealt_at[r][src.next] if dynamic and not src.dry else 0.0

        def early(m: RankMachine, src: DataSource, t: float, not_before: float) -> bool:
            # Form a partial window only when waiting for the rest of it would idle
            # the rank for longer than the configured wait.
            if src.peek(not_before) <= t:
                return False
            missing = min(cfg.buffer_size - len(m.buffer), src.remaining)
            return src.fill_s(missing) > cfg.early_form_wait_s

        clock = [0.0] * w
        tr = self.trainer(self.budget)
        padded = cfg.padded_collation
        rng = np.random.default_rng([cfg.seed, 4])
        net = cfg.hardware.network
        msg_bytes = 8 * (2 + 2 * cfg.max_steps_per_round + (3 if dynamic else 0))
        gather_s = net.allgather_s(w, msg_bytes)
        faults = cfg.faults
        gate = 0.0
        rounds = 0
        carried: set[int] = set()
        violations: list[str] = []
        fault: dict[str, Any] | None = None
        sample_of = cols.sample
        observe_events = 0
        done = False
        while not done:
            # 1. each rank fills its window, forms, and enters the collective
            contribs: list[Contribution] = []
            times: list[float] = []
            for r in range(w):
                m, src = machines[r], sources[r]
                t = clock[r]
                while True:
                    en = m.enabled()
                    if RankAction.CONTRIBUTE in en:
                        break
                    if RankAction.FORM in en:
                        t += FORM_S_PER_SAMPLE * len(m.buffer)
                        m.form()
                    elif RankAction.OBSERVE in en:
                        if src.dry:
                            m.exhaust()
                            t = max(t, src.dry_at())
                        elif RankAction.FORM_EARLY in en and early(m, src, t, dealt(r)):
                            t += FORM_S_PER_SAMPLE * len(m.buffer)
                            m.form_early()
                        else:
                            idx, t = src.pull(t, dealt(r))
                            m.observe(sample_of(idx))
                            observe_events += 1
                    else:
                        raise RuntimeError(f"rank {r}: no local action in phase {m.phase}")
                t = max(t, gate)
                contribs.append(m.contribute())
                times.append(t)
            # 2. the all-gather completes when the last rank has contributed
            coll = gather_s
            if faults.slow_collective_prob > 0 and rng.random() < faults.slow_collective_prob:
                coll *= faults.slow_collective_factor
            if faults.dead_rank is not None and times[faults.dead_rank] >= faults.dead_at_s:
                fault = self._odb_peer_failure(times, rounds, tr)
                break
            t_g = max(times) + coll
            # 3. prefetch into the window while the collective is in flight
            for r in range(w):
                m, src = machines[r], sources[r]
                t = times[r]
                while RankAction.OBSERVE in m.enabled():
                    if src.dry:
                        if src.dry_at() > t_g:
                            break
                        m.exhaust()
                    elif src.peek(dealt(r)) <= t_g:
                        idx, t = src.pull(t, dealt(r))
                        m.observe(sample_of(idx))
                        observe_events += 1
                    else:
                        break
                clock[r] = t_g
            # 4. every rank reduces the same gathered vector with decide_round
            queued = [len(m.queue) for m in machines]
            results = [machines[r].all_gather(contribs) for r in range(w)]
            rounds += 1
            if dynamic:
                for r, m in enumerate(machines):
                    new = list(m.queue)[queued[r] :]
                    shards[r].extend(new)
                    dealt_at[r].extend([t_g] * len(new))
            k = len(results[0].steps)
            if any(len(res.steps) != k for res in results):
                violations.append(
                    f"round {rounds}: ranks emitted different step counts "
                    f"{sorted({len(res.steps) for res in results})}"
                )
                break
            dones = {res.done for res in results}
            if len(dones) != 1:
                violations.append(f"round {rounds}: ranks disagree on the epoch close")
                break
            done = results[0].done
            for res in results:
                carried.update(s.id for s in res.carried)
            # 5. the trainer runs the round's aligned steps
            first_start: float | None = None
            for t_idx in range(k):
                infos = [res.steps[t_idx] for res in results]
                slots = [self._odbmake_slot(info, padded, violations) for info in infos]
                self._check_step(infos, violations)
                prev_end = tr.end
                if not tr.step(t_g, slots):
                    break
                if first_start is None:
                    first_start = max(t_g, prev_end)
                if self.progress is not None:
                    self.progress(sum(info.local_samples for info in infos))
            if tr.halted:
                fault = self._odb_peer_failure(times, rounds, tr, during_steps=True)
                break
            gate = first_start if first_start is not None else t_g
        if mode is Mode.QUOTA and done:
            for r in range(w):
                carried.update(sources[r].remaining_ids())
            carried.update(machines[0].unassigned)
        if dynamic:
            # The epoch's close: every rank's observed costs, exchanged as one byte per
            # id and combined by a bytewise maximum (the loader's all-reduce).
            # (Each id was observed by one rank, so the combined table is the record of
            # every rank's observations together: `combine` of the per-rank ones.)
            observed = {i: c for m in machines for i, c in m.observed.items()}
            self.learned = CostTable(bytes(record(observed, cols.n)))
        self.events += observe_events
        out = tr.metrics()
        samples_per_rank = [len(s) for s in shards]
        sb, rb = steps_bound(samples_per_rank), rounds_bound(samples_per_rank)
        if dynamic:
            sb, rb = dynamic_bounds(cols.n, w, protocol.target)
        out.update(
            {
                "rounds": rounds,
                "steps_bound": sb,
                "rounds_bound": rb,
                "pad_steps_by_machines": sum(m.pads for m in machines),
                "carried_ids": len(carried),
            }
        )
        if mode is Mode.QUOTA:
            out["lost_ids"] = int((tr.delivered == 0).sum()) - len(carried)
        if fault is None:
            violations.extend(self._final_checks(tr, mode, carried, machines, out))
        out["violations"] = violations
        out["timeline"] = tr.timeline()
        out["fault"] = fault
        mark_aborted(out)
        return {"metrics": out, "trainer": tr}

    def _odbmake_slot(self, info: StepInfo, padded: bool, violations: list[str]) -> Slot:
        if info.is_pad or info.batch is None:
            return self.pad_slot
        samples = info.batch.samples
        st = BatchStats.of(samples)
        cost = self.model.cost(st)
        if cost > self.budget and not (len(samples) == 1 and info.batch.oversize):
            violations.append(f"rank {info.rank} step {info.step}: batch over budget ({cost:g})")
        lens = [s.tokens + s.visual_tokens for s in samples]
        vis = sum(s.visual_tokens for s in samples)
        return make_slot(lens, info.batch.ids, padded, cost, vis)

    @staticmethod
    def _check_step(infos: Sequence[StepInfo], violations: list[str]) -> None:
        if len({i.step for i in infos}) != 1:
            violations.append(
                f"step indices differ across ranks: {sorted({i.step for i in infos})}"
            )
        gs = sum(i.local_samples for i in infos)
        gt = sum(i.local_tokens for i in infos)
        if any(i.global_samples != gs or i.global_tokens != gt for i in infos):
            violations.append(f"step {infos[0].step}: global counts disagree with local sums")

    def _final_checks(
        self,
        tr: Trainer,
        mode: Mode,
        carried: set[int],
        machines: Sequence[RankMachine],
        out: dict[str, Any],
    ) -> list[str]:
        v: list[str] = []
        d = tr.delivered
        if mode is Mode.JOIN:
            if out["lost_ids"] or out["duplicated_ids"]:
                v.append(
                    f"join mode: {out['lost_ids']} lost, {out['duplicated_ids']} duplicated ids"
                )
        else:
            both = [i for i in carried if d[i]]
            if both or out["duplicated_ids"] or out["lost_ids"]:
                v.append(
                    f"quota mode: {len(both)} ids emitted and carried, "
                    f"{out['duplicated_ids']} duplicated, {out['lost_ids']} neither"
                )
        if len({m.steps for m in machines}) != 1:
            v.append(f"ranks ended at different step counts {sorted({m.steps for m in machines})}")
        if out["steps"] > out["steps_bound"] or out["rounds"] > out["rounds_bound"]:
            v.append(
                f"bound exceeded: steps {out['steps']}/{out['steps_bound']}, "
                f"rounds {out['rounds']}/{out['rounds_bound']}"
            )
        if out["pad_steps_by_machines"] != out["pad_steps"]:
            v.append("pad steps counted by the trainer differ from the machines' count")
        return v

    def _odb_peer_failure(
        self, times: Sequence[float], round_no: int, tr: Trainer, during_steps: bool = False
    ) -> dict[str, Any]:
        f = self.cfg.faults
        dead = f.dead_rank
        assert dead is not None
        timeout = self.cfg.peer_timeout_s
        survivors = [r for r in range(self.world) if r != dead]
        # Each survivor is blocked in the round's all-gather from its contribution on;
        # the gloo group reports the missing peer after peer_timeout.
        entered = [max(times[r], f.dead_at_s) for r in survivors]
        detected = max(entered) + timeout if entered else f.dead_at_s
        if during_steps:
            detected = min(detected, f.dead_at_s + self.cfg.hardware.network.collective_timeout_s)
        errors = {
            r: str(
                ODBPeerError(
                    f"rank {r}: peer rank {dead} did not contribute to round {round_no} "
                    f"within peer_timeout={timeout:g}s"
                )
            )
            for r in survivors[:4]
        }
        return {
            "dead_rank": dead,
            "died_at_s": f.dead_at_s,
            "round": round_no,
            "detected_by": survivors,
            "detected_at_s": round(detected, 3),
            "how": "round all-gather on the gloo group times out (ODBPeerError)",
            "errors": errors,
            "epoch_completed": False,
            "steps_before_failure": tr.steps,
        }


def augmented(workload: Workload, noise: float, rng: np.random.Generator) -> Workload:
    """The workload as the next epoch sees it: every sample's tokens and preprocessing
    time scaled by one log-normal factor (sigma `noise`), as augmentation (random
    crops and resizes, template choices) would; the cached lengths stay as they were."""
    f = np.exp(rng.normal(0.0, noise, workload.n)) if noise > 0 else np.ones(workload.n)
    text = np.maximum(1, np.rint(workload.text * f)).astype(workload.text.dtype)
    visual = np.rint(workload.visual * f).astype(workload.visual.dtype)
    return replace(workload, text=text, visual=visual, prep_s=workload.prep_s * f)


def table_exchange_s(cfg: SimConfig, ids: int) -> float:
    """The epoch close's exchange of the cost table: a ring all-reduce (MAX) of one
    byte per id on the gloo group, the loader's transport."""
    w, net = cfg.ranks, cfg.hardware.network
    if w <= 1:
        return 0.0
    alpha = net.gloo_alpha_internode_s if net.nodes > 1 else net.gloo_alpha_s
    return 2 * (w - 1) * alpha + 2 * (w - 1) / w * ids / net.gloo_beta


def simulate(cfg: SimConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run every selected strategy on the same workload, for `cfg.epochs` epochs;
    returns plain data of the last epoch, with every epoch's in `epochs` when there
    are several."""
    if cfg.epochs == 1:
        return _simulate_epoch(cfg, progress, 0, {})
    tables: dict[str, CostTable | None] = {}
    learned: dict[str, CostTable | None] = {}
    workload, epochs = cfg.workload, []
    out: dict[str, Any] = {}
    for e in range(cfg.epochs):
        if e > 0:
            workload = augmented(workload, cfg.epoch_noise, np.random.default_rng([cfg.seed, 9, e]))
        out = _simulate_epoch(replace(cfg, workload=workload), progress, e, tables)
        epochs.append(
            {
                "epoch": e,
                "priced": {k: v is not None for k, v in out.pop("priced").items()},
                "samples_per_s": {k: m["samples_per_s"] for k, m in out["strategies"].items()},
                "tail_steps": {k: m["tail_steps"] for k, m in out["strategies"].items()},
                "ratios": out["ratios"],
                "ok": out["ok"],
            }
        )
        learned = out.pop("learned")
        tables = learned if cfg.cost_table else {}
    seen = next((t for t in learned.values() if t is not None), None)
    out["epochs"] = epochs
    out["ok"] = all(e["ok"] for e in epochs)
    if seen is not None:
        out["cost_table"] = {
            "ids": len(seen),
            "bytes": len(seen.codes),
            "seen": seen.seen,
            "exchange_s": round(table_exchange_s(cfg, len(seen)), 6),
        }
    return out


def _simulate_epoch(
    cfg: SimConfig,
    progress: Progress | None,
    epoch: int,
    tables: dict[str, CostTable | None],
) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    perf: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    learned: dict[str, CostTable | None] = {}
    for name in cfg.strategies:
        run = _Run(cfg, progress, epoch, tables.get(name))
        t0 = time.perf_counter()
        if name == "odb-ref":
            from simulator import odb_ref

            reason = odb_ref.unavailable(cfg.ranks)
            if reason is not None:
                skipped[name] = reason
                continue
            res = odb_ref.run(run)
        elif name == "standard":
            res = run.standard()
        elif name == "gmt":
            res = run.gmt()
        elif name == "bmt":
            res = run.bmt()
        elif name == "grouped":
            res = run.grouped()
        elif name == "grouped-modality":
            res = run.grouped_modality()
        elif name == "odb":
            res = run.odb(cfg.former, Mode.JOIN)
        elif name == "odb-bfd":
            res = run.odb(FormerKind.BEST_FIT_DECREASING, Mode.JOIN)
        else:
            res = run.odb(cfg.former, Mode.QUOTA)
        elapsed = time.perf_counter() - t0
        learned[name] = run.learned
        m = res["metrics"]
        results[name] = m
        perf[name] = {
            "sim_wall_s": round(elapsed, 3),
            "sample_events": run.events,
            "sample_events_per_min": round(run.events / elapsed * 60) if elapsed > 0 else 0,
        }
    return {
        "config": cfg.describe(),
        "workload": {"name": cfg.workload.name, **cfg.workload.stats()},
        "hardware": cfg.hardware.describe(),
        "strategies": results,
        "skipped": skipped,
        "ratios": ratios(results),
        "perf": perf,
        "ok": all(not r.get("violations") for r in results.values()),
        **({"learned": learned, "priced": dict(tables)} if cfg.epochs > 1 else {}),
    }


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    def rate(name: str) -> float | None:
        m = results.get(name)
        if m is None or m.get("fault") or not m["samples_per_s"]:
            return None
        return float(m["samples_per_s"])

    base, oracle, group = rate("standard"), rate("gmt"), rate("grouped")
    out: dict[str, dict[str, float | None]] = {}
    for name in results:
        r = rate(name)
        out[name] = {
            "vs_standard": round(r / base, 3) if r and base else None,
            "vs_gmt": round(r / oracle, 3) if r and oracle else None,
            "vs_grouped": round(r / group, 3) if r and group else None,
        }
    return out
