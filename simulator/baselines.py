"""The baselines, which are not the protocol: per-rank batch lists planned ahead
(`standard`, HF's `grouped` and LLaVA's `grouped-modality` samplers, the offline
`gmt` and `bmt` oracles on cached lengths), run with the DataLoader prefetching
whole batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from odb_core.cost import BatchStats
from odb_core.sample import Sample
from simulator import grouped_baselines as grouped
from simulator.epoch_run import Run
from simulator.slots import make_slot, mark_aborted
from simulator.trainer import Slot

# Fixed-size batches are padded whatever the cost model (a DataLoader's default collation).
_FIXED_BATCH = frozenset({"standard", "grouped", "grouped-modality"})


class Baselines(Run):
    """The baseline strategies of a run."""

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

    def _cut(self, ordered: Sequence[int], budget: float | None = None) -> list[list[int]]:
        """Greedy cut of `ordered` at the budget (or `budget`), on cached lengths (what
        an offline sampler knows)."""
        batches: list[list[int]] = []
        cur: list[int] = []
        st = BatchStats()
        c = self.cols
        cost = self.model.cost
        budget = self.budget if budget is None else budget
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

    def gmt_safe(self) -> dict[str, Any]:
        """gmt with the head-room that keeps its stale plan inside memory: it cuts at
        the largest fraction of the budget, on a 1% grid down from 1, whose batches
        all fit the token capacity once their observed lengths are known (a batch of
        one sample is exempt: no head-room shrinks it). The fraction is chosen in
        hindsight, with the observed lengths, so this is the strongest gmt a user
        could run without an out-of-memory step."""
        c = self.cols
        ordered = sorted(range(c.n), key=lambda i: (-c.cached[i], i))
        padded = self.cfg.padded_collation
        cap = self.cfg.hardware.token_capacity

        def fits(batch: list[int]) -> bool:
            lens = [c.length[i] for i in batch]
            return len(batch) == 1 or make_slot(lens, (), padded, 0.0).mem_tokens <= cap

        for pct in range(100, 0, -1):
            batches = self._cut(ordered, self.budget * pct / 100)
            if all(fits(b) for b in batches):
                break
        out = self.run_planned("gmt-safe", self._shard_batches(batches, 2), self.budget)
        out["metrics"]["headroom"] = round(1 - pct / 100, 2)
        return out

    def bmt(self) -> dict[str, Any]:
        c, size = self.cols, self.cfg.bmt_bucket
        batches: list[list[int]] = []
        for k in range(0, c.n, size):
            bucket = sorted(self.perm[k : k + size], key=lambda i: (-c.cached[i], i))
            batches.extend(self._cut(bucket))
        return self.run_planned("bmt", self._shard_batches(batches, 3), self.budget)
