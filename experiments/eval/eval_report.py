"""Summaries of ``episodes.jsonl``: per-arm solve rate with its spread over runs, tokens,
cache hits and splices; ``summary.json``, a markdown table and a PNG plot."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from .nightmare import EpisodeRecord

__all__ = ["markdown", "plot", "summarize", "write_reports"]


def summarize(records: list[EpisodeRecord], arms: list[str] | None = None) -> dict[str, Any]:
    arms = arms or list(dict.fromkeys(r.arm for r in records))
    per_arm: dict[str, Any] = {}
    for arm in arms:
        rs = [r for r in records if r.arm == arm]
        if not rs:
            continue
        by_run: dict[int, list[EpisodeRecord]] = defaultdict(list)
        for r in rs:
            by_run[r.run].append(r)
        run_rates = [sum(x.solved for x in v) / len(v) for _, v in sorted(by_run.items())]
        prompt = sum(r.prompt_tokens for r in rs)
        cached = sum(r.cached_tokens for r in rs)
        splices: dict[str, int] = defaultdict(int)
        for r in rs:
            for k, v in r.splices.items():
                splices[k] += v
        prefilled = [r.prefilled_tokens for r in rs if r.prefilled_tokens is not None]
        per_arm[arm] = {
            "episodes": len(rs),
            "solved": sum(r.solved for r in rs),
            "solve_rate": sum(r.solved for r in rs) / len(rs),
            "solve_rate_std": statistics.pstdev(run_rates) if len(run_rates) > 1 else 0.0,
            "runs": len(run_rates),
            "steps_mean": statistics.fmean(r.steps for r in rs),
            "requests": sum(r.requests for r in rs),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "prefilled_tokens": sum(prefilled) if prefilled else None,
            "splices": dict(splices),
            "wall_s": round(sum(r.wall_s for r in rs), 2),
            "timeouts": sum(r.status == "timeout" for r in rs),
            "errors": sum(r.status == "error" for r in rs),
        }
    tasks: dict[str, dict[str, str]] = defaultdict(dict)
    for arm in per_arm:
        for task in dict.fromkeys(r.task for r in records if r.arm == arm):
            rs = [r for r in records if r.arm == arm and r.task == task]
            tasks[task][arm] = f"{sum(r.solved for r in rs)}/{len(rs)}"
    return {"arms": per_arm, "tasks": dict(tasks), "episodes": len(records)}


def markdown(summary: dict[str, Any]) -> str:
    head = (
        "| arm | solved | solve rate (± std over runs) | steps | prompt tok | cached tok "
        "| hit rate | prefilled tok | splices a/f | wall s | timeouts/errors |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for arm, s in summary["arms"].items():
        sp = s["splices"]
        rows.append(
            f"| {arm} | {s['solved']}/{s['episodes']} | {s['solve_rate']:.2f} ± {s['solve_rate_std']:.2f} "
            f"| {s['steps_mean']:.1f} | {s['prompt_tokens']} | {s['cached_tokens']} "
            f"| {s['hit_rate']:.3f} | {s['prefilled_tokens'] if s['prefilled_tokens'] is not None else '-'} "
            f"| {sp.get('amortize', 0)}/{sp.get('forget', 0)} | {s['wall_s']:.1f} "
            f"| {s['timeouts']}/{s['errors']} |"
        )
    return head + "\n".join(rows) + "\n"


# The paper's mini_nightmare figures (Ma et al. 2026): solve rate without / with Leyline's
# policies, and the hit-rate gain of its policy arms over the baseline.
PAPER_SOLVE_BASELINE, PAPER_SOLVE_LEYLINE, PAPER_HIT_GAIN = 0.312, 0.455, 0.112
_LABEL = {"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 1}


def plot(summary: dict[str, Any], path: Path) -> Path:
    """Three panels: solve rate (the paper's 31.2 % -> 45.5 % as lines; "no solves" said when
    every arm is at 0), hit rate (the paper's +11.2 pp over the baseline as a line), and
    what each arm prefilled, with its splices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary["arms"])
    s = summary["arms"]
    x = list(range(len(arms)))
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 4.2))

    rates = [s[a]["solve_rate"] for a in arms]
    a1.bar(x, rates, yerr=[s[a]["solve_rate_std"] for a in arms], capsize=4, color="tab:green")
    a1.axhline(PAPER_SOLVE_BASELINE, ls="--", color="gray", lw=1)
    a1.axhline(PAPER_SOLVE_LEYLINE, ls="--", color="black", lw=1)
    a1.text(-0.4, PAPER_SOLVE_BASELINE, "paper, baseline 31.2 %", ha="left",
            va="bottom", fontsize=8, color="gray", bbox=_LABEL)  # fmt: skip
    a1.text(-0.4, PAPER_SOLVE_LEYLINE, "paper, with Leyline 45.5 %", ha="left",
            va="bottom", fontsize=8, bbox=_LABEL)  # fmt: skip
    for k, a in enumerate(arms):
        a1.text(k, rates[k] + 0.02, f"{s[a]['solved']}/{s[a]['episodes']}", ha="center", fontsize=8)
    if not any(rates):
        a1.text(0.5, 0.62, "no solves in any arm", transform=a1.transAxes, ha="center",
                fontsize=11, color="tab:red")  # fmt: skip
    a1.set_ylim(0, 1.12)
    a1.set_ylabel("solved episodes / episodes")
    a1.set_title("solve rate (± std over runs)")

    hits = [s[a]["hit_rate"] for a in arms]
    a2.bar(x, hits, color="tab:blue")
    for k, h in enumerate(hits):
        a2.text(k, h + 0.02, f"{h:.3f}", ha="center", fontsize=8)
    if "baseline" in s:
        ref = s["baseline"]["hit_rate"] + PAPER_HIT_GAIN
        if ref <= 1.0:
            a2.axhline(ref, ls="--", color="black", lw=1)
            a2.text(-0.4, ref, "paper: baseline + 11.2 pp", ha="left", va="bottom",
                    fontsize=8)  # fmt: skip
    a2.set_ylim(0, 1.1)
    a2.set_ylabel("cached / prompt tokens")
    a2.set_title("prompt-cache hit rate")

    pre = [s[a]["prefilled_tokens"] or 0 for a in arms]
    a3.bar(x, pre, color="tab:orange")
    for k, a in enumerate(arms):
        sp = s[a]["splices"]
        a3.text(k, pre[k], f"{pre[k]}\n{sp.get('amortize', 0)}a/{sp.get('forget', 0)}f splices",
                ha="center", va="bottom", fontsize=8)  # fmt: skip
    a3.set_ylim(0, max(pre + [1]) * 1.3)
    a3.set_ylabel("tokens prefilled (server counters)")
    a3.set_title("prefilled tokens and splices")

    for ax in (a1, a2, a3):
        ax.set_xticks(x, arms, rotation=15)
    fig.suptitle(f"mini_nightmare, {summary['episodes']} episodes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_reports(
    records: list[EpisodeRecord], out: Path, arms: list[str] | None = None
) -> dict[str, Any]:
    summary = summarize(records, arms)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(markdown(summary))
    if summary["arms"]:
        plot(summary, out / "summary.png")
    return summary
