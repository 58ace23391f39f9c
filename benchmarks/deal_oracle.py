"""What dynamic sharding would reach if every sample's cost were known when it is
dealt: the part of the gap to gmt that is the price of unknown costs (issue 19).

`assign.deal` prices a rank's unread ids, and the ids it deals, at the gathered
mean cost, because a cost is known only once the rank it went to has
preprocessed the sample. `OracleDeal` is the same deal with that one thing
changed: it deals exactly as many ids per round as `assign.deal` (the same
pacing: initial shares, deal target, starved ranks), in the protocol's
contiguous rank-order slices, but places them by the samples' *true* costs,
lifting the ranks of least true work to a common level. It reads the workload's
cost columns, so no online method can run it; it is a measurement, never an
option of the core. Everything else (the simulator, the protocol, the
exactly-once and step checks of every run) is unchanged.

    .venv/bin/python benchmarks/deal_oracle.py            # the issue-19 grid, seeds 0-2
    .venv/bin/python benchmarks/deal_oracle.py --ranks 256 --workload mmmix --json

Per (workload, ranks): odb/gmt with the real deal and with the oracle (medians
over the seeds, each seed in brackets), steps, tail steps and budget fill.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import deque
from collections.abc import Sequence
from typing import Any
from unittest import mock

import numpy as np

from odb_core import assign, collective
from odb_core.config import Sharding
from simulator.engine import SimConfig, simulate
from simulator.hardware import make_hardware
from simulator.workloads import make_workload


class OracleDeal:
    """`assign.deal`'s signature and pacing, with true costs in place of the mean.

    Every rank calls the deal with the same gathered list in a round, so the
    answer is computed once per list and the ids each rank has been dealt are
    tracked here (a rank reads its ids in dealt order: its unread ids are the
    last `unread` of them).
    """

    def __init__(self, plan: Sequence[int], cost: Sequence[int], world: int, target: int) -> None:
        self.plan, self.cost, self.world = list(plan), list(cost), world
        n = len(self.plan)
        t = assign.deal_target(n, world, target)
        self.dealt = [
            deque(self.plan[a:b])
            for a, b in (assign.initial_slice(r, n, world, t) for r in range(world))
        ]
        self._last: tuple[int, int] | None = None
        self._answer: tuple[int, ...] = ()

    def __call__(
        self, contributions: Sequence[Any], steps: int, plan_left: int, target: int
    ) -> tuple[int, ...]:
        key = (id(contributions), plan_left)
        if key == self._last:
            return self._answer
        total = sum(assign.deal(contributions, steps, plan_left, target))
        est = [self._true_work(r, c, steps) for r, c in enumerate(contributions)]
        cursor = len(self.plan) - plan_left
        nxt = [self.cost[i] for i in self.plan[cursor:]]
        out = self._level(est, nxt, total) if total > 0 else [0] * self.world
        for r in range(self.world):
            self.dealt[r].extend(self.plan[cursor : cursor + out[r]])
            cursor += out[r]
        self._last, self._answer = key, tuple(out)
        return self._answer

    def _true_work(self, r: int, c: Any, steps: int) -> int:
        work = int(c.held_work) + int(
            sum(c.tokens[t] for t in range(min(steps, c.offered), c.offered))
        )
        ids = self.dealt[r]
        while len(ids) > c.unread:
            ids.popleft()
        return work + sum(self.cost[i] for i in ids)

    def _level(self, est: list[int], nxt: list[int], total: int) -> list[int]:
        """The least level L whose water-fill deals at least `total` ids (in rank
        order, each rank takes the next plan ids while its true work is under L),
        stopped after `total` ids."""

        def fill(level: int, cap: int = len(nxt)) -> tuple[list[int], int]:
            out, j = [0] * self.world, 0
            for r in range(self.world):
                work = est[r]
                while j < min(len(nxt), cap) and work < level:
                    work += nxt[j]
                    j += 1
                    out[r] += 1
            return out, j

        lo, hi = 0, max(est) + sum(nxt) + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if fill(mid)[1] >= total:
                hi = mid
            else:
                lo = mid + 1
        return fill(lo, total)[0]  # at the least level, cut to the deal's count


def run_cell(
    workload: str, ranks: int, seed: int, samples: int, oracle: bool, costs: str = "true"
) -> dict[str, Any]:
    """One simulated epoch, odb with dynamic sharding and gmt. `oracle`: deal by
    `costs`: "true" (the observed costs) or "cached" (the workload's cached lengths:
    pre-augmentation, with its length noise; what gmt plans with, and what an
    earlier epoch of the same run would have observed)."""
    work = make_workload(workload, samples, seed)
    cfg = SimConfig(
        workload=work,
        ranks=ranks,
        hardware=make_hardware("h100", max(1, math.ceil(ranks / 8))),
        strategies=("gmt", "odb"),
        seed=seed,
        sharding=Sharding.DYNAMIC,
    )
    deal: Any = assign.deal
    if oracle:
        # The simulator's plan: its `_Run.perm` (rng [seed, 1]) over the workload.
        plan = np.random.default_rng([seed, 1]).permutation(work.n).tolist()
        known = work.text + work.visual if costs == "true" else work.cached
        deal = OracleDeal(plan, known.tolist(), ranks, cfg.buffer_size)
    with mock.patch.object(collective, "deal", deal):
        res = simulate(cfg)
    odb, gmt = res["strategies"]["odb"], res["strategies"]["gmt"]
    if odb["violations"] or odb["lost_ids"] or odb["duplicated_ids"]:
        raise SystemExit(f"{workload} {ranks} seed {seed}: {odb['violations'][:3]}")
    return {
        "odb_gmt": odb["samples_per_s"] / gmt["samples_per_s"],
        "steps": odb["steps"],
        "gmt_steps": gmt["steps"],
        "tail_steps": odb["tail_steps"],
        "fill": odb["budget_fill"],
        "gmt_fill": gmt["budget_fill"],
        "rounds": odb["rounds"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", default="sharegpt4o,mmmix")
    ap.add_argument("--ranks", default="8,16,64,256,1024")
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--costs",
        choices=("true", "cached"),
        default="true",
        help="what the oracle deals by: the true costs, or the cached lengths (gmt's)",
    )
    ap.add_argument("--json", action="store_true", help="every run as JSON")
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    rows: list[dict[str, Any]] = []
    for wl in a.workload.split(","):
        for ranks in (int(r) for r in a.ranks.split(",")):
            cell: dict[str, Any] = {"workload": wl, "ranks": ranks}
            for name, oracle in (("real", False), ("oracle", True)):
                cell[name] = [run_cell(wl, ranks, s, a.samples, oracle, a.costs) for s in seeds]
            rows.append(cell)
            if not a.json:
                print(_line(cell), flush=True)
            else:
                print(f"{wl} {ranks}: done", file=sys.stderr, flush=True)
    if a.json:
        out = {"samples": a.samples, "seeds": seeds, "costs": a.costs, "cells": rows}
        print(json.dumps(out, indent=1))
    return 0


def _line(cell: dict[str, Any]) -> str:
    def part(runs: list[dict[str, Any]]) -> str:
        med = statistics.median(r["odb_gmt"] for r in runs)
        each = " ".join(f"{r['odb_gmt']:.2f}" for r in runs)
        fill = statistics.median(r["fill"] for r in runs)
        return (
            f"{med:.2f} ({each}) steps {'/'.join(str(r['steps']) for r in runs)} "
            f"tail {'/'.join(str(r['tail_steps']) for r in runs)} fill {fill:.3f}"
        )

    gmt = cell["real"][0]
    return (
        f"{cell['workload']:10} {cell['ranks']:5}  real deal {part(cell['real'])}  |  "
        f"oracle {part(cell['oracle'])}  |  gmt steps {gmt['gmt_steps']} fill {gmt['gmt_fill']:.3f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
