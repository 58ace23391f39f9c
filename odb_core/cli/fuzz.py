"""`odb fuzz`: many adversarial schedules over W RankMachines, every guarantee asserted."""

from __future__ import annotations

import argparse
import json
from typing import Any

from odb_core.cli.arguments import (
    add_json_flag,
    add_progress_flag,
    enum_choice,
    positive_int,
    progress_bar,
    subcommand,
    wants_progress,
)
from odb_core.config import Sharding
from odb_core.verify.bugs import BugVariant


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subcommand(
        sub,
        "fuzz",
        run,
        help="random and hypothesis-driven adversarial schedules at large world sizes",
        description=(
            "Drive W odb_core RankMachines (W up to --ranks, at most 1024) through random "
            "adversarial schedules (arrival orders, per-rank speeds, stragglers, exhaustion "
            "and receive timing) plus hypothesis searches that maximise step count and tail "
            "length; assert step alignment, coverage, quota closure, budget safety, loss "
            "normalisation, deadlock freedom and the proven step/round bounds."
        ),
    )
    p.add_argument("--ranks", type=_ranks, default=64, help="largest world size (<= 1024)")
    p.add_argument("--schedules", type=positive_int, default=200, help="random schedules")
    p.add_argument("--seed", type=int, default=0, help="first schedule seed")
    p.add_argument(
        "--search-examples",
        type=int,
        default=None,
        help="examples per hypothesis search (default schedules/5; 0 disables)",
    )
    p.add_argument(
        "--bug",
        type=enum_choice(BugVariant),
        default=None,
        help="fuzz a deliberately broken machine (must be caught): "
        + ", ".join(b.value for b in BugVariant),
    )
    p.add_argument(
        "--sharding",
        type=enum_choice(Sharding),
        default=Sharding.STATIC,
        help="static (default) or dynamic: the random schedules' samples are dealt by "
        "the core each round (the hypothesis searches stay static)",
    )
    p.add_argument("--replay", type=int, default=None, metavar="SEED", help="rerun one schedule")
    add_json_flag(p)
    add_progress_flag(p)


def _ranks(text: str) -> int:
    value = positive_int(text)
    if value > 1024:
        raise argparse.ArgumentTypeError(f"{text!r} must be <= 1024")
    return value


def run(args: argparse.Namespace) -> int:
    from odb_core.protocol import RankMachine
    from simulator.fuzz import fuzz, replay
    from simulator.tables import format_fuzz

    bug: BugVariant | None = args.bug
    machine = bug.machine if bug is not None else RankMachine
    if args.search_examples is not None and args.search_examples < 0:
        raise ValueError(f"--search-examples {args.search_examples!r} must be >= 0")
    if bug is not None and bug.passes > 1:
        return _fuzz_passes(bug, args)
    if args.replay is not None:
        o = replay(args.replay, args.ranks, machine)
        summary = o.summary()
        if args.json:
            print(json.dumps({"ok": o.ok, "schedule": summary}))
        else:
            print(json.dumps(summary, indent=2))
        return 0 if o.ok else 1
    bar = _bar(args)
    try:
        report = fuzz(
            args.ranks,
            args.schedules,
            args.seed,
            machine=machine,
            search_examples=args.search_examples,
            sharding=args.sharding,
            progress=(lambda n: bar.update(n)) if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()
    out: dict[str, Any] = report.to_json()
    out["max_ranks"] = args.ranks
    if bug is not None:
        out["bug"] = {"variant": bug.value, "expected": bug.violates, "caught": not report.ok}
    if args.json:
        print(json.dumps(out))
    else:
        print(format_fuzz(out))
        if bug is not None:
            print(f"  bug variant {bug.value}: {'CAUGHT' if not report.ok else 'MISSED'}")
    if bug is not None:
        return 0 if not report.ok else 1
    return 0 if report.ok else 1


def _fuzz_passes(bug: BugVariant, args: argparse.Namespace) -> int:
    """A cross-epoch variant shows only over passes: 8 passes of random quota
    settings (odb_core.verify.fairness.fuzz_passes)."""
    from odb_core.verify.fairness import fuzz_passes

    failures, carrying, held = fuzz_passes(args.schedules, args.seed, machine=bug.machine)
    caught = bool(failures)
    out = {
        "ok": not failures,
        "configs": args.schedules,
        "passes_with_carry": carrying,
        "passes_meeting_hypothesis": held,
        "violations": len(failures),
        "first": failures[:3],
        "bug": {"variant": bug.value, "expected": bug.violates, "caught": caught},
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
        print(f"  bug variant {bug.value}: {'CAUGHT' if caught else 'MISSED'}")
    return 0 if caught else 1


def _bar(args: argparse.Namespace) -> Any:
    if not wants_progress(args):
        return None
    return progress_bar(total=args.schedules, desc="schedules")
