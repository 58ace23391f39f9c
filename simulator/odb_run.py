"""The odb strategies: W `odb_core` RankMachines, one per rank, driven through an
epoch on the simulated DataLoaders, collective and trainer. Every batching
decision is the machines'; the round semantics are the core's `decide_round`,
reached through `RankMachine.all_gather`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from odb_core.assign import dynamic_bounds
from odb_core.collective import Contribution
from odb_core.config import Mode, ProtocolConfig, Sharding
from odb_core.cost import BatchStats, Budget
from odb_core.cost_table import CostTable, record
from odb_core.errors import ODBPeerError
from odb_core.formers import FormerKind
from odb_core.protocol import RankAction, RankMachine, RoundResult, rounds_bound, steps_bound
from odb_core.step import StepInfo
from simulator.dataloader import DataSource
from simulator.epoch_run import Run
from simulator.slots import make_slot, mark_aborted
from simulator.trainer import Slot, Trainer

# Host-side cost of the batcher per formed window sample (sorting, bookkeeping).
FORM_S_PER_SAMPLE = 2e-6


class OdbRun(Run):
    """The odb strategies of a run."""

    def odb(self, former: FormerKind, mode: Mode) -> dict[str, Any]:
        """One epoch of odb (`mode` join or quota, `former` forming each window)."""
        return _OdbEpoch(self, self.protocol(former, mode)).run()

    def protocol(self, former: FormerKind, mode: Mode) -> ProtocolConfig:
        """The ranks' protocol config, as the loader builds it from the same options."""
        cfg = self.cfg
        dynamic = cfg.sharding_in_force is Sharding.DYNAMIC
        return ProtocolConfig(
            world_size=self.world,
            budget=Budget(self.budget),
            cost_model=self.model,
            buffer_size=cfg.buffer_size,
            mode=mode,
            former=former,
            oversize=cfg.oversize,
            max_steps_per_round=cfg.max_steps_per_round,
            quota=cfg.quota if mode is Mode.QUOTA else None,
            sharding=cfg.sharding_in_force,
            plan=tuple(self.perm) if dynamic else (),
            cost_table=self.cost_table if dynamic else None,
            early_form=cfg.early_form if mode is Mode.JOIN else None,
        )

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


class _OdbEpoch:
    """One odb epoch: the ranks' machines and sources, the round collective and the
    trainer, round by round."""

    def __init__(self, run: OdbRun, protocol: ProtocolConfig) -> None:
        cfg, w = run.cfg, run.world
        self.owner, self.cfg, self.w, self.protocol = run, cfg, w, protocol
        self.mode = protocol.mode
        self.dynamic = dynamic = protocol.dynamic
        self.machines = machines = [RankMachine(r, protocol) for r in range(w)]
        # Static: rank r reads its fixed shard. Dynamic: rank r reads the ids the core
        # deals it, in order; a worker starts an id no earlier than its deal.
        self.shards = [list(m.queue) if dynamic else run.perm[r::w] for r, m in enumerate(machines)]
        self.dealt_at = [[0.0] * len(s) for s in self.shards]
        depth = max(cfg.prefetch_factor * cfg.num_workers, cfg.buffer_size)
        self.sources = [run.source(r, self.shards[r], depth) for r in range(w)]
        self.clock = [0.0] * w
        self.tr = run.trainer(run.budget)
        self.padded = cfg.padded_collation
        self.rng = np.random.default_rng([cfg.seed, 4])
        msg_bytes = 8 * (2 + 2 * cfg.max_steps_per_round + (3 if dynamic else 0))
        self.gather_s = cfg.hardware.network.allgather_s(w, msg_bytes)
        self.faults = cfg.faults
        self.gate = 0.0
        self.rounds = 0
        self.carried: set[int] = set()
        self.violations: list[str] = []
        self.fault: dict[str, Any] | None = None
        self.sample_of = run.cols.sample
        self.observe_events = 0
        self.done = False

    def dealt(self, r: int) -> float:
        """The time rank r's next id was dealt (static sharding: 0)."""
        src = self.sources[r]
        return self.dealt_at[r][src.next] if self.dynamic and not src.dry else 0.0

    def early(self, m: RankMachine, src: DataSource, t: float, not_before: float) -> bool:
        # Form a partial window only when waiting for the rest of it would idle
        # the rank for longer than the configured wait.
        if src.peek(not_before) <= t:
            return False
        missing = min(self.cfg.buffer_size - len(m.buffer), src.remaining)
        return src.fill_s(missing) > self.cfg.early_form_wait_s

    def run(self) -> dict[str, Any]:
        while not self.done and self.round():
            pass
        return self.close()

    def round(self) -> bool:
        """One round; False once the epoch cannot go on (a fault or a violation)."""
        w, faults = self.w, self.faults
        # 1. each rank fills its window, forms, and enters the collective
        contribs: list[Contribution] = []
        times: list[float] = []
        for r in range(w):
            t = max(self.fill(r), self.gate)
            contribs.append(self.machines[r].contribute())
            times.append(t)
        # 2. the all-gather completes when the last rank has contributed
        coll = self.gather_s
        if faults.slow_collective_prob > 0 and self.rng.random() < faults.slow_collective_prob:
            coll *= faults.slow_collective_factor
        if faults.dead_rank is not None and times[faults.dead_rank] >= faults.dead_at_s:
            self.fault = self.owner._odb_peer_failure(times, self.rounds, self.tr)
            return False
        t_g = max(times) + coll
        # 3. prefetch into the window while the collective is in flight
        for r in range(w):
            self.prefetch(r, times[r], t_g)
        # 4. every rank reduces the same gathered vector with decide_round
        results = self.gather(contribs, t_g)
        if results is None:
            return False
        # 5. the trainer runs the round's aligned steps
        first_start = self.train(results, t_g)
        if self.tr.halted:
            self.fault = self.owner._odb_peer_failure(
                times, self.rounds, self.tr, during_steps=True
            )
            return False
        self.gate = first_start if first_start is not None else t_g
        return True

    def fill(self, r: int) -> float:
        """Rank r's local actions up to its contribution; the time it is ready."""
        m, src = self.machines[r], self.sources[r]
        t = self.clock[r]
        while True:
            en = m.enabled()
            if RankAction.CONTRIBUTE in en:
                return t
            if RankAction.FORM in en:
                t += FORM_S_PER_SAMPLE * len(m.buffer)
                m.form()
            elif RankAction.OBSERVE in en:
                if src.dry:
                    m.exhaust()
                    t = max(t, src.dry_at())
                elif RankAction.FORM_EARLY in en and self.early(m, src, t, self.dealt(r)):
                    t += FORM_S_PER_SAMPLE * len(m.buffer)
                    m.form_early()
                else:
                    idx, t = src.pull(t, self.dealt(r))
                    m.observe(self.sample_of(idx))
                    self.observe_events += 1
            else:
                raise RuntimeError(f"rank {r}: no local action in phase {m.phase}")

    def prefetch(self, r: int, t: float, t_g: float) -> None:
        """Rank r observes what arrives before the collective completes at t_g."""
        m, src = self.machines[r], self.sources[r]
        while RankAction.OBSERVE in m.enabled():
            if src.dry:
                if src.dry_at() > t_g:
                    break
                m.exhaust()
            elif src.peek(self.dealt(r)) <= t_g:
                idx, t = src.pull(t, self.dealt(r))
                m.observe(self.sample_of(idx))
                self.observe_events += 1
            else:
                break
        self.clock[r] = t_g

    def gather(self, contribs: list[Contribution], t_g: float) -> list[RoundResult] | None:
        """Every rank's `all_gather` of the round's vectors; None if the ranks
        disagree on its steps or on the epoch's close."""
        machines = self.machines
        queued = [len(m.queue) for m in machines]
        results = [machines[r].all_gather(contribs) for r in range(self.w)]
        self.rounds += 1
        if self.dynamic:
            for r, m in enumerate(machines):
                new = list(m.queue)[queued[r] :]
                self.shards[r].extend(new)
                self.dealt_at[r].extend([t_g] * len(new))
        k = len(results[0].steps)
        if any(len(res.steps) != k for res in results):
            self.violations.append(
                f"round {self.rounds}: ranks emitted different step counts "
                f"{sorted({len(res.steps) for res in results})}"
            )
            return None
        dones = {res.done for res in results}
        if len(dones) != 1:
            self.violations.append(f"round {self.rounds}: ranks disagree on the epoch close")
            return None
        self.done = results[0].done
        for res in results:
            self.carried.update(s.id for s in res.carried)
        return results

    def train(self, results: list[RoundResult], t_g: float) -> float | None:
        """The round's aligned steps on the trainer; when the first one started."""
        run, tr = self.owner, self.tr
        first_start: float | None = None
        for t_idx in range(len(results[0].steps)):
            infos = [res.steps[t_idx] for res in results]
            slots = [run._odbmake_slot(info, self.padded, self.violations) for info in infos]
            run._check_step(infos, self.violations)
            prev_end = tr.end
            if not tr.step(t_g, slots):
                break
            if first_start is None:
                first_start = max(t_g, prev_end)
            if run.progress is not None:
                run.progress(sum(info.local_samples for info in infos))
        return first_start

    def close(self) -> dict[str, Any]:
        """The epoch's metrics, with what odb carried, its bounds and its checks."""
        run, tr, machines, w, mode = self.owner, self.tr, self.machines, self.w, self.mode
        if mode is Mode.QUOTA and self.done:
            for r in range(w):
                self.carried.update(self.sources[r].remaining_ids())
            self.carried.update(machines[0].unassigned)
        if self.dynamic:
            # The epoch's close: every rank's observed costs, exchanged as one byte per
            # id and combined by a bytewise maximum (the loader's all-reduce).
            # (Each id was observed by one rank, so the combined table is the record of
            # every rank's observations together: `combine` of the per-rank ones.)
            observed = {i: c for m in machines for i, c in m.observed.items()}
            run.learned = CostTable(bytes(record(observed, run.cols.n)))
        run.events += self.observe_events
        out = tr.metrics()
        samples_per_rank = [len(s) for s in self.shards]
        sb, rb = steps_bound(samples_per_rank), rounds_bound(samples_per_rank)
        if self.dynamic:
            priced = self.protocol.cost_table is not None
            sb, rb = dynamic_bounds(run.cols.n, w, self.protocol.configured_target, priced)
        out.update(
            {
                "rounds": self.rounds,
                "steps_bound": sb,
                "rounds_bound": rb,
                "pad_steps_by_machines": sum(m.pads for m in machines),
                "carried_ids": len(self.carried),
            }
        )
        if mode is Mode.QUOTA:
            out["lost_ids"] = int((tr.delivered == 0).sum()) - len(self.carried)
        violations = self.violations
        if self.fault is None:
            violations.extend(run._final_checks(tr, mode, self.carried, machines, out))
        out["violations"] = violations
        out["timeline"] = tr.timeline()
        out["fault"] = self.fault
        mark_aborted(out)
        return {"metrics": out, "trainer": tr}
