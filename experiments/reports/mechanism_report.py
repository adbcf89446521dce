"""Outputs of the mechanism benchmark: ``results.json``, ``results.md``, ``results.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["markdown", "plot", "write_reports"]


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| arm | C | hit rate | prefilled tok | TTFT p50 / p90 s | e2e p50 / p90 s "
        "| splices a/f | peak cache tok | reps |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["arm"])):
        spread = f" ({r['hit_rate_min']:.3f}-{r['hit_rate_max']:.3f})" if r["reps"] > 1 else ""
        lines.append(
            f"| {r['arm']} | {r['concurrency']} | {r['hit_rate']:.3f}{spread} "
            f"| {r['prefilled_tokens']:.0f} | {r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} "
            f"| {r['e2e_p50_s']:.3f} / {r['e2e_p90_s']:.3f} "
            f"| {r['splices']['amortize']:.0f}/{r['splices']['forget']:.0f} "
            f"| {r['peak_cache_tokens']:.0f} | {r['reps']} |"
        )
    return head + "\n".join(lines) + "\n"


# What each replay arm is, in words (the legend), in the order the tables of docs/measurements.md read.
ARM_LABELS = {
    "full": "full history, no edits",
    "radix": "edits, prefix cache only",
    "splice": "edits + Leyline AMORTIZE",
    "forget": "edits + Leyline FORGET",
    "nocache": "no prefix cache",
}
PAPER_HIT_GAIN = 0.112  # the paper: Leyline's hit rate over the plain prefix cache, +11.2 pp


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Hit rate, prefilled tokens, TTFT and end-to-end latency against C. Arms that coincide
    stay visible (each its own marker, dash and a small sideways offset); the x axis has
    exactly the measured C values; the paper's +11.2 pp over the prefix cache is a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    arms = list(dict.fromkeys(r["arm"] for r in rows))
    cs = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.4))
    panels = (
        ("hit_rate", "cache hit rate", "cached / prompt tokens"),
        ("prefilled_tokens", "prefilled tokens per arm", "tokens prefilled (all requests)"),
        ("ttft_p50_s", "time to first token, p50", "seconds"),
        ("e2e_p50_s", "end-to-end latency, p50", "seconds"),
    )
    for ax, (key, title, ylabel) in zip(axes, panels, strict=True):
        for k, arm in enumerate(arms):
            rs = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["concurrency"])
            shift = 2 ** (0.06 * (k - (len(arms) - 1) / 2))  # sideways, so equal arms show
            xs = [r["concurrency"] * shift for r in rs]
            ys = [r[key] for r in rs]
            lo = [max(0.0, r[key] - r.get(key + "_min", r[key])) for r in rs]
            hi = [max(0.0, r.get(key + "_max", r[key]) - r[key]) for r in rs]
            ax.errorbar(
                xs,
                ys,
                yerr=[lo, hi],
                marker="osD^v"[k % 5],
                capsize=3,
                label=ARM_LABELS.get(arm, arm),
                linestyle=("-", "--", "-.", ":")[k % 4],
                markersize=7,
                markerfacecolor="none" if k % 2 else None,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(cs[0] / 1.5, cs[-1] * 1.5)
        ax.set_xlabel("sessions in flight (C)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(bottom=0 if key != "hit_rate" else -0.04)
    radix = [r["hit_rate"] for r in rows if r["arm"] == "radix"]
    if radix:
        ref = sum(radix) / len(radix) + PAPER_HIT_GAIN
        axes[0].axhline(ref, color="gray", ls="--", lw=1)
        axes[0].text(cs[0] / 1.45, ref + 0.01, "paper: prefix cache + 11.2 pp", fontsize=8,
                     color="gray")  # fmt: skip
    axes[0].set_ylim(-0.04, 1.05)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_reports(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    (out / "results.md").write_text(markdown(rows))
    plot(rows, out / "results.png")
