"""The learned cost table's exchange on real gloo ranks (issue 32): what an epoch's
close costs when every rank contributes one byte per dataset id.

Each rank records costs for its share of the ids (`odb_core.cost_table.record`,
every W-th id), and the loader's transport combines them with one all-reduce MAX
of a uint8 tensor (`GlooTransport.reduce_max`); the benchmark times that call and
checks that every rank got the same table, which prices every id. Also the
table's state size (zlib of the codes, as `state_dict()` carries it).

    .venv/bin/python benchmarks/cost_table_exchange.py                # 4 ranks, 10M ids
    .venv/bin/python benchmarks/cost_table_exchange.py --ranks 2 --ids 1000000 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from odb_core.bench.launch import free_port, init_local_gloo, release_child_resources
from odb_core.cost_table import CostTable, record


def _rank(rank: int, world: int, port: int, ids: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    from odb_core.torch.transport import GlooTransport

    init_local_gloo(rank, world, port, timeout_s=300)
    t = GlooTransport(300.0)
    t.connect({})
    # Costs of a VLM-like spread (40 to ~40,000 tokens), a deterministic function of id.
    mine = bytes(record({i: 40 + (i * 7919) % 40_000 for i in range(rank, ids, world)}, ids))
    times = []
    codes = b""
    for _ in range(repeats):
        dist.barrier(group=t.group)
        start = time.perf_counter()
        codes = t.reduce_max(mine, "the benchmark's exchange")
        times.append(time.perf_counter() - start)
    table = CostTable(codes)
    result = {
        "times_s": times,
        "crc32": zlib.crc32(codes),
        "seen": table.seen,
        "state_bytes": len(table.to_state()["codes"]),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    release_child_resources()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ids", type=int, default=10_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [
            ctx.Process(target=_rank, args=(r, a.ranks, port, a.ids, a.repeats, out))
            for r in range(a.ranks)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(600)
        rows: list[dict[str, Any]] = []
        for r in range(a.ranks):
            path = Path(out, f"rank{r}.json")
            if not path.exists():
                print(f"rank {r} wrote nothing", file=sys.stderr)
                return 1
            rows.append(json.loads(path.read_text()))
    agree = len({row["crc32"] for row in rows}) == 1 and all(r["seen"] == a.ids for r in rows)
    per_repeat = [max(row["times_s"][k] for row in rows) for k in range(a.repeats)]
    summary = {
        "ranks": a.ranks,
        "ids": a.ids,
        "table_bytes": a.ids,
        "state_bytes": rows[0]["state_bytes"],
        "exchange_s_median": round(statistics.median(per_repeat), 4),
        "exchange_s": [round(x, 4) for x in per_repeat],
        "same_table_on_every_rank": agree,
    }
    if a.json:
        print(json.dumps(summary))
    else:
        print(
            f"{a.ranks} gloo ranks, {a.ids:,} ids: table {a.ids:,} bytes, state "
            f"{summary['state_bytes']:,} bytes; exchange median "
            f"{summary['exchange_s_median']} s {summary['exchange_s']}; every rank the "
            f"same table: {agree}"
        )
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
