"""The `quality` part of `odb bench --model --quality`: its markdown table and its
plot (held-out loss against training wall time, every seed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def _x(v: object) -> str:
    return "not reached" if v is None else f"{float(v):.2f}x"  # type: ignore[arg-type]


def _pct(v: object) -> str:
    return "-" if v is None else f"{100 * float(v):+.1f}%"  # type: ignore[arg-type]


def iter_quality_table(result: dict[str, Any]) -> Iterator[str]:
    q = result["quality"]
    p = result["params"]
    yield ""
    yield (
        f"time to quality ({q['regime']} regime, {q['epochs']} epochs, held-out loss every "
        f"1/{q['checkpoints_per_epoch']} epoch, {q['schedule']}; medians of {p['repeats']} seeds; "
        "target: standard's final held-out loss in the same seed)"
    )
    yield (
        "| strategy | train wall s | final held-out loss | seeds reaching target "
        "| time to target / standard | time to target / grouped "
        "| held-out gap vs standard | held-out gap vs grouped |"
    )
    yield "|---|---|---|---|---|---|---|---|"
    for name, r in q["strategies"].items():
        yield (
            f"| {name} | {r['train_wall_s']:.1f} | {r['final_held_out_loss']:.4f} | "
            f"{r['reached']}/{p['repeats']} | {_x(r['time_to_target_ratio'])} | "
            f"{_x(r['time_to_target_ratio_vs_grouped']) if 'heldout_gap_vs_grouped' in r else '-'}"
            f" | {_pct(r['heldout_gap'])} | "
            f"{_pct(r.get('heldout_gap_vs_grouped'))} |"
        )


def _label(name: str, row: dict[str, Any]) -> str:
    ratio = row["time_to_target_ratio"]
    vs_grouped = row.get("time_to_target_ratio_vs_grouped")
    if ratio is None:
        return f"{name} (target not reached)"
    extra = "" if vs_grouped is None else f", {vs_grouped:.2f}x grouped's"
    return f"{name} (target at {ratio:.2f}x standard's time{extra})"


def plot_quality(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q = result["quality"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    cmap = plt.get_cmap("tab10")
    target = None
    for k, (name, row) in enumerate(result["strategies"].items()):
        for seed, run in enumerate(row["runs"]):
            curve = run["curve"]
            ax.plot(
                [c[0] for c in curve],
                [c[2] for c in curve],
                color=cmap(k % 10),
                alpha=0.9 if seed == 0 else 0.35,
                label=_label(name, q["strategies"][name]) if seed == 0 else None,
                marker="." if seed == 0 else None,
            )
        if name == "standard":
            target = q["strategies"]["standard"]["final_held_out_loss"]
    if target is not None:
        ax.axhline(target, color="k", ls=":", lw=1, label="standard's final (median)")
    ax.set_xlabel("training wall time, s (held-out evaluation excluded)")
    ax.set_ylabel("held-out loss per token")
    ax.legend(fontsize=8)
    p = result["params"]
    ax.set_title(
        f"odb bench --model {p['model']} --quality ({q['regime']}, {q['epochs']} epochs, "
        f"{p['ranks']} gloo ranks, CPU; seed 0 bold)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
