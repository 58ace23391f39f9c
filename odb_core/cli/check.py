"""`odb check`: model-check the DGAP protocol on a small configuration."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from odb_core.bugs import BugVariant
from odb_core.checker import CheckReport, check
from odb_core.cli.options import enum_choice, int_list, positive_int
from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import Budget
from odb_core.formers import FormerKind
from odb_core.model import ModelConfig, round_robin_shards


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "check",
        help="explicit-state check of every guarantee on a small configuration",
        description=(
            "Explore every reachable state of W ranks x N samples (all arrival orders, "
            "exhaustion timings and rank interleavings) and check step alignment, identity "
            "coverage, quota closure, budget safety, deadlock freedom and bounded termination."
        ),
    )
    p.add_argument("--engine", choices=["python"], default="python")
    p.add_argument("--ranks", type=positive_int, default=3, help="world size W (default 3)")
    p.add_argument("--samples", type=positive_int, default=6, help="samples N (default 6)")
    p.add_argument(
        "--buffer",
        type=positive_int,
        default=1,
        help="window K per rank (default 1: the most interleavings)",
    )
    p.add_argument("--budget", type=positive_int, default=4, help="token budget (default 4)")
    p.add_argument(
        "--costs",
        type=int_list,
        default=None,
        help="comma-separated sample costs, cycled over N (default 1,2,3)",
    )
    p.add_argument("--mode", type=enum_choice(Mode), default=Mode.JOIN)
    p.add_argument("--quota", type=positive_int, default=None, help="global sample quota")
    p.add_argument("--former", type=enum_choice(FormerKind), default=FormerKind.SORT_WINDOW_GREEDY)
    p.add_argument("--max-steps-per-round", type=positive_int, default=2)
    p.add_argument("--deterministic", action="store_true", help="in-order arrivals only")
    p.add_argument(
        "--bug",
        type=enum_choice(BugVariant),
        default=None,
        help="check a deliberately broken variant on its own small model: "
        + ", ".join(b.value for b in BugVariant),
    )
    p.add_argument("--max-states", type=positive_int, default=2_000_000)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    costs = args.costs or [1, 2, 3]
    cycled = [costs[i % len(costs)] for i in range(args.samples)]
    protocol = ProtocolConfig(
        world_size=args.ranks,
        budget=Budget(args.budget),
        buffer_size=args.buffer,
        mode=args.mode,
        former=args.former,
        max_steps_per_round=args.max_steps_per_round,
        quota=args.quota,
        deterministic=args.deterministic,
    )
    return ModelConfig(protocol, round_robin_shards(cycled, args.ranks))


def run(args: argparse.Namespace) -> int:
    if args.bug is not None:
        bug: BugVariant = args.bug
        report = check(bug.model(), max_states=args.max_states, properties=[bug.violates])
        out = report.to_json()
        out["bug"] = {
            "variant": bug.value,
            "expected_violation": bug.violates,
            "caught": bug.violates in report.violated(),
        }
        _emit(out, report, args.json)
        return 0 if out["bug"]["caught"] else 1
    progress = None if args.json else _progress
    report = check(model_from_args(args), max_states=args.max_states, progress=progress)
    _emit(report.to_json(), report, args.json)
    return 0 if report.ok else 1


def _progress(n: int) -> None:
    print(f"  ... {n:,} states", file=sys.stderr, flush=True)


def _emit(out: dict[str, Any], report: CheckReport, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
        return
    print(format_report(out, report))


def format_report(out: dict[str, Any], report: CheckReport) -> str:
    c = out["config"]
    lines = [
        f"odb check (python): W={c['world_size']} N={c['samples']} K={c['buffer_size']} "
        f"budget={c['budget_tokens']} mode={c['mode']} former={c['former']}"
        + (f" machine={c['machine']}" if c["machine"] != "RankMachine" else ""),
        f"  states {out['states']:,}  edges {out['edges']:,}  terminal {out['terminal_states']}"
        f"  deadlocks {out['deadlocks']}  acyclic {out['acyclic']}"
        f"  ({out['elapsed_s']}s, {out['states_per_s']:,} states/s)",
        f"  steps: max seen {out['max_steps_seen']} / bound {out['steps_bound']}   "
        f"rounds: max seen {out['max_rounds_seen']} / bound {out['rounds_bound']}   "
        f"longest schedule {out['longest_schedule']} actions",
    ]
    if "bug" in out:
        b = out["bug"]
        verdict = "CAUGHT" if b["caught"] else "MISSED"
        lines.append(
            f"  bug variant {b['variant']}: expected {b['expected_violation']} -> {verdict}"
        )
    if not report.violations:
        lines.append("  all guarantees hold" if report.complete else "  INCOMPLETE: state cap hit")
    for v in report.violations:
        lines.append(f"  VIOLATION {v.property}: {v.reason}")
        lines.append("    trace: " + " -> ".join(v.trace))
    return "\n".join(lines)
