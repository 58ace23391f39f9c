"""The output of `odb bench --model`: its markdown tables and its plot (throughput
bars and the per-step timeline; with `--quality`, held-out loss curves)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def iter_table(result: dict[str, Any]) -> Iterator[str]:
    p = result["params"]
    yield (
        f"odb bench --model {p['model']}: {p['ranks']} gloo ranks (DDP, CPU), {p['samples']} "
        f"samples up to {p['max_len']} tokens, budget {p['budget']} tokens/rank/step "
        f"(standard batch {p['fixed_batch']}), {p['repeats']} interleaved repeats (medians)"
        + (
            f"; LoRA: {p['trainable_parameters']:,} of {p['parameters']:,} parameters train"
            if p.get("lora")
            else ""
        )
    )
    yield (
        "| strategy | samples/s | incl. pass | tokens/s | padding | steps/rank | pad steps "
        "| data wait s | collate s | vision fwd s | all-gather s | peak RSS MB | /dev/shm MB "
        "| equal steps, once | train loss/token | held-out loss |"
    )
    yield "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    for name, r in result["strategies"].items():
        label = name
        if r["precompute_s"] > 0:
            label = f"{name} (+{r['precompute_s']:.2f} s length pass)"
        steps = r["steps_per_rank"]
        steps_s = str(steps[0]) if len(set(steps)) == 1 else "/".join(map(str, steps))
        yield (
            f"| {label} | {r['samples_per_s']:.2f} | {r['samples_per_s_incl_precompute']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {100 * r['padding']:.1f}% | {steps_s} | "
            f"{r['pad_steps']:.0f} | {r['data_wait_s']:.2f} | {r['collate_s']:.2f} | "
            f"{r.get('vision_forward_s', 0.0):.2f} | "
            f"{r['allgather_stall_s']:.2f} | {r['peak_rss_mb']:.0f} | "
            f"{r.get('dev_shm_peak_mb', 0.0):.0f} | "
            f"{'yes' if r['equal_steps'] and r['exactly_once'] else 'no'} | "
            f"{r['train_loss_per_token']:.4f} | {r['held_out_loss']:.4f} |"
        )
    yield ""
    yield "| ratio (paired medians of samples/s) | value |"
    yield "|---|---|"
    for k, v in result["ratios"].items():
        yield f"| {k} | {v:.2f}x |"
    for note in result["notes"]:
        yield f"note: {note}"
    if "quality" in result:
        from odb_core.bench.quality_output import iter_quality_table

        yield from iter_quality_table(result)
    for name, row in result["strategies"].items():
        if "loader" in row:
            yield f"{name}: {in_force(row['loader'])}"
    yield f"equal steps and exactly-once ids in every odb-core run: {result['ok']}"


def in_force(described: dict[str, Any]) -> str:
    """One line of what an odb-core loader ran with (its `describe()`)."""
    sharding = described.get("sharding", "static")
    line = f"{sharding} sharding ({described.get('sharding_reason', '')}), "
    line += f"window {described['buffer_size']}, {described['former']} former"
    if described.get("early_form") is not None:
        line += f", early forms from {described['early_form']} samples"
    return line


def plot(result: dict[str, Any], path: str) -> None:
    if "quality" in result:
        from odb_core.bench.quality_output import plot_quality

        plot_quality(result, path)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["strategies"])
    rows = result["strategies"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 2.2]})
    vals = [rows[n]["samples_per_s"] for n in names]
    bars = ax1.bar(
        names, vals, color=["#999", "#a7c", "#6a9", "#36c", "#139", "#c63"][: len(names)]
    )
    if "gmt" in rows:
        i = names.index("gmt")
        ax1.bar(
            [names[i]],
            [rows["gmt"]["samples_per_s_incl_precompute"]],
            fill=False,
            hatch="//",
            edgecolor="k",
            label="gmt incl. length pass",
        )
        ax1.legend(fontsize=8)
    for b, v in zip(bars, vals, strict=True):
        ax1.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    vs_grouped = [
        f"{k.split('/')[0]}/grouped {v:.2f}x"
        for k, v in result["ratios"].items()
        if k.endswith("/grouped") and k != "grouped/standard"
    ]
    if vs_grouped:  # the paired medians, as in the ratio table
        ax1.text(0.02, 0.78, "\n".join(vs_grouped), transform=ax1.transAxes, fontsize=7, va="top")
    ax1.set_ylabel("emitted samples/s (median)")
    ax1.set_title("throughput", fontsize=10)
    ax1.tick_params(axis="x", labelrotation=30, labelsize=8)
    cmap = plt.get_cmap("RdYlGn_r")
    timelines = result["timeline_rank0_last_repeat"]
    for y, n in enumerate(names):
        for t, wait, comp, real, computed, _, pad in timelines.get(n) or []:
            pad_share = 1.0 - real / max(1, computed)
            color = "#ccc" if pad else cmap(pad_share)
            ax2.broken_barh(
                [(t + wait, comp)], (y - 0.35, 0.7), facecolors=color, edgecolor="k", linewidth=0.2
            )
            if wait > 0.005:
                ax2.broken_barh([(t, wait)], (y - 0.35, 0.7), facecolors="#000")
    ax2.set_yticks(range(len(names)), names, fontsize=8)
    ax2.set_xlabel(
        "seconds into the epoch (rank 0, last repeat)\ncolour: the step's padding share "
        "(green 0%, red 100%); black: data wait; grey: pad step",
        fontsize=8,
    )
    ax2.set_title("per-step timeline", fontsize=10)
    fig.suptitle(
        f"odb bench --model {result['params']['model']} (measured on CPU, "
        f"{result['params']['ranks']} gloo ranks)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
