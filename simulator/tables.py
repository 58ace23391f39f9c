"""Human-readable tables and matplotlib plots for simulation and fuzz results."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (header, width, metric key, kind): kind "r" ratio, "%" fraction, "f" float, "d" integer.
_COLUMNS = (
    ("samples/s", 10, "samples_per_s", "f"),
    ("tokens/s", 10, "tokens_per_s", "d"),
    ("vs std", 6, "vs_standard", "r"),
    ("vs gmt", 6, "vs_gmt", "r"),
    ("vs grp", 6, "vs_grouped", "r"),
    ("pad%", 5, "padding_ratio", "%"),
    ("fill%", 5, "budget_fill", "%"),
    ("steps", 6, "steps", "d"),
    ("pad-st", 6, "pad_steps", "d"),
    ("tail", 4, "tail_steps", "d"),
    ("wait%", 5, "data_wait_fraction", "%"),
    ("OOM", 4, "oom_steps", "d"),
    ("lost", 4, "lost_ids", "d"),
    ("dup", 4, "duplicated_ids", "d"),
)


_SAFE_COLUMN = ("vs safe", 7, "vs_gmt_safe", "r")  # only when gmt-safe ran


def _columns(run: dict[str, Any]) -> tuple[tuple[str, int, str, str], ...]:
    if "gmt-safe" not in run["strategies"]:
        return _COLUMNS
    return (*_COLUMNS[:4], _SAFE_COLUMN, *_COLUMNS[4:])


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _cell(value: Any, width: int, kind: str) -> str:
    if value is None and kind != "r":
        return f"{'-':>{width}}"
    if kind == "r":
        text = _ratio(value)
    elif kind == "%":
        text = f"{100 * float(value):.1f}"
    elif kind == "f":
        text = f"{float(value):,.2f}"
    else:
        text = f"{int(value):,}"
    return f"{text:>{width}}"


def format_run(run: dict[str, Any]) -> str:
    c = run["config"]
    wl = run["workload"]
    columns = _columns(run)
    lines = [
        f"odb simulate: {c['workload']} ({wl['samples']:,} samples, mean {wl['mean_tokens']:,.0f} "
        f"tokens, CV {wl['cv']}), {c['ranks']} ranks on {c['nodes']} node(s), "
        f"{run['hardware']['accelerator']['name']}, budget {c['budget_tokens']:,} tokens "
        f"({c['cost_model']}), standard batch size {c['standard_batch_size']}, odb "
        f"sharding {c['sharding']}",
        f"{'strategy':<16} " + " ".join(f"{h:>{w}}" for h, w, _, _ in columns),
    ]
    for name, m in run["strategies"].items():
        r = run["ratios"].get(name, {})
        cells = [
            _cell(r.get(key) if kind == "r" else m[key], w, kind) for _, w, key, kind in columns
        ]
        lines.append(f"{name:<16} " + " ".join(cells))
    for name, reason in run.get("skipped", {}).items():
        lines.append(f"{name:<16} {reason}")
    for name, m in run["strategies"].items():
        for v in m.get("violations") or []:
            lines.append(f"  VIOLATION {name}: {v}")
        f = m.get("fault")
        if f:
            when = "never" if f["detected_at_s"] is None else f"at {f['detected_at_s']}s"
            lines.append(
                f"  fault {name}: rank {f['dead_rank']} died at {f['died_at_s']}s; "
                f"{len(f['detected_by'])} ranks reported it {when} ({f['how']})"
            )
    safe = run["strategies"].get("gmt-safe")
    if safe is not None and "headroom" in safe:
        lines.append(
            f"  gmt-safe: cut at {100 * (1 - safe['headroom']):.0f}% of the budget, the "
            "largest share whose batches all fit memory"
        )
    odb = run["strategies"].get("odb")
    if odb is not None and "rounds" in odb:
        lines.append(
            f"  odb: {odb['rounds']} rounds (bound {odb['rounds_bound']}), {odb['steps']} steps "
            f"(bound {odb['steps_bound']}), {odb['wall_s']:,.1f}s simulated"
        )
    for e in run.get("epochs", []):
        odb_r = e["ratios"].get("odb", {})
        safe_r = odb_r.get("vs_gmt_safe")
        lines.append(
            f"  epoch {e['epoch'] + 1}: odb {e['samples_per_s'].get('odb')} samples/s, "
            f"odb/gmt {odb_r.get('vs_gmt')}"
            + (f", odb/gmt-safe {safe_r}" if safe_r is not None else "")
            + f", tail {e['tail_steps'].get('odb')} steps"
            + (
                ", shares and deals priced by the learned cost table"
                if e["priced"].get("odb")
                else ""
            )
        )
    perf = run.get("perf", {})
    if "odb" in perf:
        p = perf["odb"]
        lines.append(
            f"  simulator: odb ran in {p['sim_wall_s']}s of CPU, "
            f"{p['sample_events_per_min']:,} sample events/min"
        )
    return "\n".join(lines)


def format_summary(runs: Sequence[dict[str, Any]]) -> str:
    """One line per run: odb ratios and the baselines' OOM steps."""
    lines = [
        f"{'workload':<11} {'ranks':>5} {'nodes':>5} {'odb/std':>8} {'odb/gmt':>8} {'odb/grp':>8} "
        f"{'bfd/std':>8} {'odb fill':>8} {'gmt OOM':>7} {'odb lost/dup':>12}"
    ]
    for run in runs:
        c, r, s = run["config"], run["ratios"], run["strategies"]
        odb = s.get("odb", {})
        lines.append(
            f"{c['workload']:<11} {c['ranks']:>5} {c['nodes']:>5} "
            f"{_ratio(r.get('odb', {}).get('vs_standard')):>8} "
            f"{_ratio(r.get('odb', {}).get('vs_gmt')):>8} "
            f"{_ratio(r.get('odb', {}).get('vs_grouped')):>8} "
            f"{_ratio(r.get('odb-bfd', {}).get('vs_standard')):>8} "
            f"{100 * odb.get('budget_fill', 0):>7.1f}% "
            f"{s.get('gmt', {}).get('oom_steps', '-'):>7} "
            f"{str(odb.get('lost_ids', '-')) + '/' + str(odb.get('duplicated_ids', '-')):>12}"
        )
    return "\n".join(lines)


def markdown_table(runs: Sequence[dict[str, Any]]) -> str:
    names = ["standard", "gmt", "bmt", "grouped", "grouped-modality"]
    names += ["odb", "odb-bfd", "odb-quota", "odb-ref"]
    present = [n for n in names if any(n in run["strategies"] for run in runs)]
    padded = [n for n in ("odb", "gmt", "grouped") if n in present]
    headers = ["workload", "ranks (nodes)", *(f"{n} samples/s" for n in present)]
    headers += ["odb / standard", "odb / gmt", "odb / grouped"]
    headers += [*(f"{n} padding" for n in padded), "odb fill", "gmt OOM steps"]
    rows = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for run in runs:
        c, s, r = run["config"], run["strategies"], run["ratios"]
        cells = [c["workload"], f"{c['ranks']} ({c['nodes']})"]
        cells += [f"{s[n]['samples_per_s']:.1f}" if n in s else "-" for n in present]
        cells += [
            _ratio(r.get("odb", {}).get("vs_standard")),
            _ratio(r.get("odb", {}).get("vs_gmt")),
            _ratio(r.get("odb", {}).get("vs_grouped")),
        ]
        cells += [f"{100 * s[n]['padding_ratio']:.1f}%" if n in s else "-" for n in padded]
        cells += [
            f"{100 * s['odb']['budget_fill']:.1f}%" if "odb" in s else "-",
            str(s["gmt"]["oom_steps"]) if "gmt" in s else "-",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(runs: Sequence[dict[str, Any]], path: str | Path, timeline_strategy: str = "odb") -> None:
    """Throughput per strategy (ratio to standard when several runs are shown) and a
    per-rank timeline of the epoch tail of `timeline_strategy` in the first run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8.5), gridspec_kw={"height_ratios": [1.1, 1]})
    strategies: list[str] = []
    for run in runs:
        for n in run["strategies"]:
            if n not in strategies:
                strategies.append(n)
    many = len(runs) > 1
    if many:
        width = 0.8 / max(1, len(strategies))
        for j, name in enumerate(strategies):
            vals = [r["ratios"].get(name, {}).get("vs_standard") or 0.0 for r in runs]
            xs = [i + (j - (len(strategies) - 1) / 2) * width for i in range(len(runs))]
            bars = ax1.bar(xs, vals, width, label=name)
            if name == "odb":
                notes = [_ratio(r["ratios"].get(name, {}).get("vs_grouped")) for r in runs]
                ax1.bar_label(bars, [f"{t}\nvs grouped" for t in notes], fontsize=6)
        ax1.set_xticks(range(len(runs)))
        ax1.set_xticklabels(
            [
                f"{r['config']['workload']}\nW={r['config']['ranks']}, {r['config']['nodes']} node"
                + ("s" if r["config"]["nodes"] > 1 else "")
                for r in runs
            ],
            fontsize=8,
        )
        ax1.axhline(1.0, color="black", lw=0.6)
        ax1.set_ylabel("emitted samples/s relative to standard")
        ax1.legend(fontsize=8, ncol=4, loc="upper left", framealpha=0.9)
    else:
        vals = [float(m["samples_per_s"]) for m in runs[0]["strategies"].values()]
        bars = ax1.bar(range(len(vals)), vals, 0.6, color=[f"C{i}" for i in range(len(vals))])
        ax1.bar_label(bars, fmt="%.1f", fontsize=8)
        ax1.set_xticks(range(len(vals)))
        ax1.set_xticklabels(list(runs[0]["strategies"]), fontsize=9)
        c = runs[0]["config"]
        ax1.set_ylabel(f"emitted samples/s ({c['workload']}, W={c['ranks']})")
        vs_grouped = runs[0]["ratios"].get("odb", {}).get("vs_grouped")
        if vs_grouped is not None:
            ax1.text(
                0.99,
                0.95,
                f"odb / grouped = {_ratio(vs_grouped)}",
                ha="right",
                va="top",
                transform=ax1.transAxes,
                fontsize=9,
            )
    ax1.set_title("Simulated throughput per strategy (emitted samples / simulated wall time)")
    first = runs[0]
    m = first["strategies"].get(timeline_strategy)
    tl = m.get("timeline") if m else None
    if tl:
        t0 = tl[0]["start"]
        ranks = len(tl[0]["compute_end"])
        for step in tl:
            for r in range(ranks):
                start, cend = step["start"] - t0, step["compute_end"][r] - t0
                pad = step["pad"][r]
                ax2.barh(
                    r,
                    cend - start,
                    left=start,
                    color="#888888" if pad else "#1f77b4",
                    hatch="//" if pad else None,
                    edgecolor="white",
                    linewidth=0.4,
                )
                ax2.barh(
                    r,
                    step["end"] - step["compute_end"][r],
                    left=cend,
                    color="#ffdd99",
                    edgecolor="white",
                    linewidth=0.4,
                )
        ax2.set_xlabel("seconds since the start of the window")
        ax2.set_ylabel("rank")
        ax2.set_title(
            f"{timeline_strategy}, last {len(tl)} steps of the epoch "
            f"({first['config']['workload']}, W={ranks}): blue real batch, grey hatched pad step, "
            "yellow waiting for peers,"
            " exposed all-reduce and optimizer",
            fontsize=9,
        )
        ax2.invert_yaxis()
    else:
        ax2.set_axis_off()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_fuzz(report: dict[str, Any]) -> str:
    lines = [
        f"odb fuzz: {report['schedules']} schedules "
        f"({', '.join(f'{k} {v}' for k, v in report['by_origin'].items())}), "
        f"W up to {report['max_world_size']}, {report['samples']:,} samples, "
        f"{report['actions']:,} actions in {report['elapsed_s']}s",
        f"  violations: {report['violations']}",
    ]
    for v in report["violation_examples"][:5]:
        lines.append(
            f"    seed {v['seed']} ({v['origin']}, W={v['world_size']}, mode={v['mode']}): "
            + "; ".join(v["violations"][:2])
        )
    lines.append(f"  {'worst case':<12} {'found':>6} {'bound':>6} {'ratio':>6}  schedule")
    for key, w in report["worst"].items():
        if not w:
            continue
        s = w["schedule"]
        bound = "-" if w["bound"] is None else str(w["bound"])
        ratio = "-" if w["ratio_to_bound"] is None else f"{w['ratio_to_bound']:.2f}"
        lines.append(
            f"  {key:<12} {w['value']:>6} {bound:>6} {ratio:>6}  seed {s['seed']} ({s['origin']}), "
            f"W={s['world_size']}, N={s['samples']}, K={s['buffer_size']}, "
            f"M={s['max_steps_per_round']}, {s['mode']}, {s['former']}, budget {s['budget']}"
        )
    lines.append("  " + ("all guarantees hold" if report["ok"] else "GUARANTEES VIOLATED"))
    return "\n".join(lines)
