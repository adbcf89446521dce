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


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(r["arm"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (
        ("hit_rate", "cache hit rate (cached / prompt tokens)"),
        ("ttft_p50_s", "TTFT p50 (s)"),
        ("e2e_p50_s", "end-to-end p50 (s)"),
    )
    for ax, (key, title) in zip(axes, panels, strict=True):
        for arm in arms:
            rs = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in rs]
            ys = [r[key] for r in rs]
            lo = [r[key] - r[key + "_min"] for r in rs]
            hi = [r[key + "_max"] - r[key] for r in rs]
            k = arms.index(arm)  # distinct marker and dash: equal arms (splice/forget) overlap
            ax.errorbar(
                xs,
                ys,
                yerr=[lo, hi],
                marker="osD^x"[k % 5],
                capsize=3,
                label=arm,
                linestyle=("-", "--", "-.", ":")[k % 4],
                markersize=7 - k,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sessions in flight (C)")
        ax.set_title(title)
    axes[0].set_ylim(0, 1.02)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_reports(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    (out / "results.md").write_text(markdown(rows))
    plot(rows, out / "results.png")
