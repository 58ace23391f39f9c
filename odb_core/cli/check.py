"""`odb check`: model-check the DGAP protocol, with the Python checker and/or TLC.

`--engine python` (default) explores one configuration with the Python checker.
`--engine tlc` runs TLC on every model of spec/manifest.json (or `--model NAME`)
and compares each result with its pins; `--engine both` also explores each model
with the Python checker and compares the two state graphs. `--adhoc` runs TLC on
the configuration given by the other options instead. `--trace FILE...` validates
a recorded protocol trace (one file per rank, or one merged file).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from odb_core.cli.arguments import add_json_flag, enum_choice, int_list, positive_int, subcommand
from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import Budget
from odb_core.formers import FormerKind
from odb_core.verify import tlc
from odb_core.verify.bugs import BugVariant
from odb_core.verify.checker import PROPERTIES, CheckReport, check
from odb_core.verify.fairness import check_variant
from odb_core.verify.model import ModelConfig, round_robin_shards


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subcommand(
        sub,
        "check",
        run,
        help="model-check every guarantee (Python checker, TLC, conformance, traces)",
        description=(
            "Explore every reachable state of W ranks x N samples (all arrival orders, "
            "exhaustion timings and rank interleavings) and check step alignment, identity "
            "coverage, quota closure, budget safety, deadlock freedom and bounded termination: "
            "with the Python checker (--engine python), with TLC on spec/DGAP.tla against the "
            "pinned models of spec/manifest.json (--engine tlc), or both, comparing their "
            "state graphs (--engine both). --trace validates a recorded run."
        ),
    )
    p.add_argument(
        "--engine",
        choices=["python", "tlc", "both"],
        default=None,
        help="python: the Python checker on one configuration (default); tlc: TLC on every "
        "model of spec/manifest.json vs its pins; both: TLC, the Python checker and a "
        "state-graph comparison (default for --trace: both)",
    )
    p.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="NAME",
        help="with --engine tlc|both: only this manifest model (repeatable)",
    )
    p.add_argument(
        "--all-models",
        action="store_true",
        help='with --engine tlc|both: also the slow manifest models ("slow": true: inductive '
        "checks, minutes each; left out by default so a check takes about a minute)",
    )
    p.add_argument(
        "--adhoc",
        action="store_true",
        help="with --engine tlc|both: check the configuration given by the options below "
        "instead of the manifest models",
    )
    p.add_argument(
        "--trace",
        nargs="+",
        default=None,
        metavar="FILE",
        help="validate a recorded protocol trace (per-rank JSON files of one run, merged)",
    )
    p.add_argument("--workers", type=positive_int, default=1, help="TLC workers per model run")
    p.add_argument("--parallel", type=positive_int, default=2, help="TLC runs at once (default 2)")
    p.add_argument(
        "--timeout",
        type=positive_int,
        default=3600,
        help="hang guard: seconds per TLC run (default 3600; the models are finite)",
    )
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
    add_json_flag(p)


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
    if args.trace:
        return run_trace(args)
    engine = args.engine or "python"
    if engine != "python":
        return run_adhoc(args, engine) if args.adhoc else run_manifest(args, engine)
    if args.bug is not None:
        bug: BugVariant = args.bug
        report = check_variant(bug, max_states=args.max_states)
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


# ---- TLC and conformance -----------------------------------------------------


_PY_PROPERTY = {"deadlock": ("DeadlockFreedom",), "liveness": ("Termination", "DeadlockFreedom")}


def _python_property(verdict: str) -> tuple[str, ...]:
    """The Python checker's names for a TLC verdict."""
    if verdict.startswith("invariant:"):
        return (verdict.split(":", 1)[1],)
    return _PY_PROPERTY.get(verdict, ())


def _python_side(m: tlc.ManifestModel) -> tuple[dict[str, Any] | None, CheckReport | None]:
    """The Python checker on the same model: correct models fully (with the graph,
    for conformance), bug models mirrored in bugs.py on the property they break."""
    if not m.generated:
        return None, None  # the inductive checks: no Python counterpart
    if m.bug is None:
        if m.expected != "ok":
            return None, None  # a witness model: only TLC pins it
        report = check(m.model_config(), keep_graph=m.conformance)
        out: dict[str, Any] = {
            "ok": report.ok,
            "states": report.states,
            "edges": report.edges,
            "elapsed_s": round(report.elapsed_s, 2),
            "violations": sorted(report.violated()),
        }
        return out, report
    mirrored = {b.value: b for b in BugVariant}.get(m.bug)
    props = [p for p in _python_property(m.expected) if p in PROPERTIES]
    if mirrored is None or not props:
        return None, None
    report = check(m.model_config(mirrored.machine), properties=props, max_states=300_000)
    caught = bool(report.violated() & set(props))
    return {"variant": mirrored.value, "properties": props, "caught": caught}, report


def _python_agrees(py: dict[str, Any] | None) -> bool:
    if py is None:
        return True
    return all(py.get(k, True) for k in ("ok", "states_equal", "caught"))


def run_manifest(args: argparse.Namespace, engine: str) -> int:
    start = time.perf_counter()
    models = tlc.load_manifest()
    models, skipped = select_models(models, args.model, args.bug, all_models=args.all_models)
    out = check_manifest(models, engine=engine, parallel=args.parallel, timeout=args.timeout)
    out["skipped_slow"] = skipped
    out["elapsed_s"] = round(time.perf_counter() - start, 1)
    if args.json:
        print(json.dumps(out))
    else:
        print(format_manifest(out))
    return 0 if out["ok"] else 1


def select_models(
    models: list[tlc.ManifestModel],
    names: list[str] | None,
    bug: BugVariant | None,
    *,
    all_models: bool = False,
) -> tuple[list[tlc.ManifestModel], list[str]]:
    """The models `odb check` runs, and the slow ones it leaves out: a model named
    with --model always runs; otherwise slow models only with --all-models."""
    if names:
        known = {m.name for m in models}
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(f"no manifest model {unknown}; known: {sorted(known)}")
        models = [m for m in models if m.name in names]
    if bug is not None:
        models = [m for m in models if m.bug == bug.value]
    if names or all_models:
        return models, []
    return [m for m in models if not m.slow], [m.name for m in models if m.slow]


def check_manifest(
    models: list[tlc.ManifestModel],
    *,
    engine: str = "both",
    parallel: int = 2,
    timeout: float = 600,
) -> dict[str, Any]:
    """Run TLC on `models` (and, for `both`, the Python checker and the state-graph
    comparison); one JSON-friendly object with every model vs its pins."""
    from odb_core.verify.conformance import compare_graphs, parse_dot

    both = engine == "both"
    with tempfile.TemporaryDirectory(prefix="odb-check-") as tmp:
        results = tlc.run_manifest(
            models,
            parallel=parallel,
            dump_dot=lambda m: both and m.conformance,
            keep_dir=Path(tmp),
            timeout=timeout,
        )
        rows = []
        conformance = []
        for m in models:
            r = results[m.name]
            diffs = tlc.compare_with_manifest(m, r)
            row: dict[str, Any] = {
                "name": m.name,
                "about": m.about,
                "bug": m.bug,
                "expected": m.expected,
                "pinned": {k: m.expect.get(k) for k in ("distinct_states", "depth")},
                **r.to_json(with_trace=bool(diffs)),
                "matches_manifest": not diffs,
                "diffs": diffs,
            }
            if diffs and r.trace:
                row["trace_text"] = r.format_trace()
            if both:
                py, report = _python_side(m)
                if py is not None and m.bug is None:
                    py["states_equal"] = py["states"] == r.distinct_states
                row["python"] = py
                if m.conformance and report is not None and report.graph is not None:
                    if r.dot_path is None:
                        c: dict[str, Any] = {"name": m.name, "equal": False, "error": "no dump"}
                    else:
                        graph = parse_dot(r.dot_path)
                        c = compare_graphs(graph, report.graph, name=m.name).to_json()
                    row["conformance"] = c
                    conformance.append(c)
            rows.append(row)
    python_ok = all(_python_agrees(row.get("python")) for row in rows)
    graphs_equal = bool(conformance) and all(c["equal"] for c in conformance)
    out: dict[str, Any] = {
        "engine": engine,
        "tlc": "2.15",
        "manifest": str(tlc.spec_dir() / "manifest.json"),
        "models": rows,
        "all_as_pinned": all(row["matches_manifest"] for row in rows),
    }
    if both:
        out["python_agrees"] = python_ok
        out["graphs_equal"] = graphs_equal
        out["conformance"] = conformance
    out["ok"] = out["all_as_pinned"] and (not both or (python_ok and graphs_equal))
    return out


def format_manifest(out: dict[str, Any]) -> str:
    both = out["engine"] == "both"
    lines = [
        f"odb check ({out['engine']}): {len(out['models'])} TLC models vs {out['manifest']}",
        f"  {'model':32} {'expected':32} {'TLC':7} {'states':>7} {'depth':>5} {'time':>6}"
        + ("  python        graph" if both else ""),
    ]
    for row in out["models"]:
        mark = "pinned" if row["matches_manifest"] else "DIFFERS"
        line = (
            f"  {row['name']:32} {row['expected']:32} {mark:7} "
            f"{row['distinct_states'] or 0:>7,} {row['depth'] or 0:>5} {row['elapsed_s']:>5.1f}s"
        )
        if both:
            py = row.get("python")
            if py is None:
                line += "  -           "
            elif "caught" in py:
                line += f"  {'caught' if py['caught'] else 'MISSED':12}"
            else:
                line += f"  {'ok' if py['ok'] else 'FAIL'} {py['states']:>7,}"
            conf = row.get("conformance")
            if conf is not None:
                line += "  equal" if conf["equal"] else "  DIFFERENT"
        lines.append(line)
        for d in row["diffs"]:
            lines.append(f"      {d}")
        if row.get("message"):
            lines.append(f"      {row['message']}")
        if row.get("trace_text"):
            lines.append(row["trace_text"])
    pinned = sum(r["matches_manifest"] for r in out["models"])
    summary = f"  {pinned}/{len(out['models'])} models as pinned"
    if both:
        conf = out["conformance"]
        summary += (
            f"; graphs_equal: {str(out['graphs_equal']).lower()} "
            f"({sum(c['equal'] for c in conf)}/{len(conf)} state graphs equal to the Python "
            f"model's); python agrees: {str(out['python_agrees']).lower()}"
        )
    lines.append(summary)
    if out.get("skipped_slow"):
        lines.append(
            f"  left out (slow, minutes each; --all-models runs them): "
            f"{', '.join(out['skipped_slow'])}"
        )
    if "elapsed_s" in out:
        lines.append(f"  elapsed {out['elapsed_s']}s")
    return "\n".join(lines)


def run_adhoc(args: argparse.Namespace, engine: str) -> int:
    """TLC (and, for `both`, the Python checker and conformance) on the options' model."""
    from odb_core.verify.conformance import check_conformance

    start = time.perf_counter()
    cfg = model_from_args(args)
    name = "MCadhoc"
    with tempfile.TemporaryDirectory(prefix="odb-check-") as tmp:
        tla, cfg_text = tlc.render_model(name, cfg, tlc.CheckSpec(specification="LiveSpec"))
        res = tlc.run_tlc(
            name,
            {f"{name}.tla": tla, f"{name}.cfg": cfg_text},
            workers=args.workers,
            dump_dot=engine == "both",
            keep_dir=Path(tmp),
            timeout=args.timeout,
        )
        out: dict[str, Any] = {"engine": engine, "adhoc": True, "tlc": res.to_json()}
        ok = res.result == "ok"
        if engine == "both" and res.dot_path is not None:
            c = check_conformance(cfg, res.dot_path, name=name)
            out["graphs_equal"] = c.equal
            out["conformance"] = [c.to_json()]
            ok &= c.equal
    out["ok"] = ok
    out["elapsed_s"] = round(time.perf_counter() - start, 1)
    if args.json:
        print(json.dumps(out))
    else:
        t = out["tlc"]
        print(
            f"odb check ({engine}, adhoc): TLC {t['result']}  states {t['distinct_states']}  "
            f"depth {t['depth']}  ({t['elapsed_s']}s)"
        )
        if res.message:
            print(f"  {res.message}")
        if res.trace:
            print(res.format_trace())
        if "graphs_equal" in out:
            print(f"  graphs_equal: {str(out['graphs_equal']).lower()}")
        print(f"  elapsed {out['elapsed_s']}s")
    return 0 if ok else 1


def run_trace(args: argparse.Namespace) -> int:
    """Validate a recorded trace with the Python model and/or TLC."""
    from odb_core.verify.tlc import validate_trace_tlc
    from odb_core.verify.trace_validation import ProtocolTrace, validate_trace

    engine = args.engine or "both"
    trace = ProtocolTrace.merge(args.trace)
    out: dict[str, Any] = {"engine": engine, "trace": list(args.trace)}
    ok = True
    for which, fn in (("python", validate_trace), ("tlc", validate_trace_tlc)):
        if engine in (which, "both"):
            start = time.perf_counter()
            report = fn(trace)
            out[which] = {
                **report.to_json(),
                "elapsed_s": round(time.perf_counter() - start, 2),
            }
            ok &= report.ok
    out["ok"] = ok
    if args.json:
        print(json.dumps(out))
    else:
        for which in ("python", "tlc"):
            if which in out:
                r = out[which]
                verdict = "accepted" if r["ok"] else f"REJECTED: {r['reason']}"
                print(f"trace ({which}): {r['actions']} actions, {verdict} ({r['elapsed_s']}s)")
    return 0 if ok else 1


def demo_section() -> bool:
    """A short TLC tour for `odb demo` (well under a minute on 2 cores)."""
    print("== DGAP in TLA+: spec/DGAP.tla checked by TLC 2.15 (a sample of spec/manifest.json) ==")
    problem = tlc.installation_problem()
    if problem:
        print(f"  TLC is not available: {problem}")
        return False
    start = time.perf_counter()
    ok_models = ("MCjoin_w2_n4_k1", "MCquota_w2_n8_k2_q3", "MCjoin_w3_n6_k1", "MCInductive_join")
    mirrored = {b.value for b in BugVariant}
    bugs = ("MCno_fairness_bug", "MCstale_inbox_bug", "MCjoin_closes_early_bug")
    models = [
        m
        for m in tlc.load_manifest()
        if m.name in (*ok_models, *bugs) or (m.bug in mirrored and "agreement" not in m.name)
    ]
    out = check_manifest(models, engine="both")
    for row in out["models"]:
        verdict = row["result"] if row["matches_manifest"] else f"{row['result']} (DIFFERS)"
        extra = ""
        if row.get("conformance"):
            extra = "  graph == Python's" if row["conformance"]["equal"] else "  GRAPHS DIFFER"
        print(
            f"  {row['name']:32} {verdict:34} {row['distinct_states'] or 0:>6,} states"
            f"  depth {row['depth'] or 0:>3}{extra}"
        )
    ok = bool(out["ok"])
    from odb_core.verify.conformance import record_random_trace
    from odb_core.verify.tlc import validate_trace_tlc

    cfg = next(m for m in models if m.name == "MCjoin_w3_n6_k1").model_config()
    report = validate_trace_tlc(record_random_trace(cfg, seed=7))
    ok &= report.ok
    print(
        f"  a recorded 3-rank trace ({len(report.actions)} actions) replayed through the spec: "
        f"{'accepted' if report.ok else 'REJECTED: ' + report.reason}"
    )
    print(
        f"  {'all as pinned' if out['all_as_pinned'] else 'NOT as pinned'}, "
        f"graphs_equal: {str(out['graphs_equal']).lower()}  "
        f"({time.perf_counter() - start:.1f}s)"
    )
    return ok
