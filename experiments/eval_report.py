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


def plot(summary: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary["arms"])
    s = summary["arms"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    a1.bar(
        arms,
        [s[a]["solve_rate"] for a in arms],
        yerr=[s[a]["solve_rate_std"] for a in arms],
        capsize=4,
        color="tab:green",
    )
    a1.set_ylim(0, 1)
    a1.set_ylabel("solve rate")
    a1.set_title("mini_nightmare solve rate (± std over runs)")
    a2.bar(arms, [s[a]["hit_rate"] for a in arms], color="tab:blue")
    a2.set_ylim(0, 1)
    a2.set_ylabel("cached / prompt tokens")
    a2.set_title("prompt cache hit rate")
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=20)
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
