"""``leyline bench mechanism``: replay hit rate, prefill and latency per arm and concurrency.

For every concurrency C and repetition: a fresh engine per arm (the model is loaded once and
shared; the KV pools and prefix caches are new), the same sessions replayed with C in flight
(``replay.py``), the arms' jobs interleaved (job k of every arm before job k + 1 of any, so a
change of machine load lands on all arms alike), and one row per arm: hit rate = cached prompt tokens / prompt tokens, tokens
prefilled, TTFT and end-to-end p50/p90, splices executed, peak cache tokens. Repetitions
are aggregated into mean and spread (min-max) per (arm, C). Outputs: ``results.json``
(rows), ``runs.json`` (every repetition), ``results.md`` and ``results.png``.

``--quick``: C from ``--concurrency`` but sessions = max(C), 10 turns per session, tool
outputs cut to 400 characters, no tool schemas in the prompt (debug-gym's cost ~1k tokens),
1 generated token, 1 repetition: the reduced set of the main job (prompts stay under ~1k
tokens; the ``mini`` model prefills a few hundred tokens per second on 2 busy cores). Ten
turns, not fewer: the stale-tool rule (keep 2) first edits at a session's fourth turn, so a
shorter session is mostly turns that no arm edits. Full: every turn of each trajectory (up
to 40), max(C, 16) sessions, 3 repetitions.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leyline_agent.errors import LeylineError

from ..options import csv_ints
from ..replay.replay import ARMS, replay_interleaved
from ..replay.trajectories import DEFAULT_SET, TrajectoryRecord, load_trajectories

__all__ = ["BenchSettings", "add_arguments", "main", "run_mechanism"]

POLICIES: list[Any] = [{"name": "stale-tool", "keep": 2}, {"name": "failed-call"}]
QUICK_TURNS = 10  # turns per session of --quick (see the module docstring)


@dataclass(slots=True)
class BenchSettings:
    concurrency: list[int]
    arms: list[str]
    reps: int
    sessions: int
    max_turns: int | None
    max_message_chars: int | None
    max_tokens: int = 8
    cache_budget_tokens: int = 65536
    dtype: str = "float32"
    max_tool_description_chars: int | None = None
    with_tools: bool = True

    @classmethod
    def make(
        cls,
        concurrency: list[int],
        arms: list[str],
        quick: bool,
        reps: int | None,
        dtype: str = "float32",
    ) -> BenchSettings:
        unknown = [a for a in arms if a not in ARMS]
        if unknown:
            raise LeylineError(
                f"--arms: unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}"
            )
        if reps is not None and reps < 1:
            raise LeylineError(f"--reps: must be >= 1, got {reps}")
        if quick:
            return cls(
                concurrency,
                arms,
                reps or 1,
                max(concurrency),
                QUICK_TURNS,
                400,
                max_tokens=1,
                dtype=dtype,
                with_tools=False,
            )
        return cls(concurrency, arms, reps or 3, max(max(concurrency), 16), None, None, dtype=dtype)


def cap_messages(
    traj: TrajectoryRecord, max_chars: int | None, max_description_chars: int | None = None
) -> TrajectoryRecord:
    """Cut long tool/system contents (middle elided) and tool descriptions (quick runs)."""
    if max_description_chars:
        tools = []
        for t in traj.tools:
            fn = dict(t.get("function", {}))
            fn["description"] = str(fn.get("description", ""))[:max_description_chars]
            params = dict(fn.get("parameters") or {})
            params["properties"] = {
                name: {
                    **spec,
                    "description": str(spec.get("description", ""))[: max_description_chars // 2],
                }
                for name, spec in (params.get("properties") or {}).items()
            }
            fn["parameters"] = params
            tools.append({**t, "function": fn})
        traj = traj.model_copy(update={"tools": tools})
    if not max_chars:
        return traj
    msgs = []
    for m in traj.messages:
        c = m.get("content")
        if m.get("role") in ("tool", "system") and isinstance(c, str) and len(c) > max_chars:
            m = {**m, "content": c[: max_chars // 2] + "\n[...]\n" + c[-max_chars // 2 :]}
        msgs.append(m)
    return traj.model_copy(update={"messages": msgs})


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _run_rows(
    loaded: Any, arms: list[str], c: int, rep: int, trajs: list[TrajectoryRecord],
    st: BenchSettings,
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per arm: a fresh engine each (the model shared), the arms' jobs interleaved
    (``replay_interleaved``) so that they are timed under the same machine load."""
    from leyline_agent.engine.engine import Engine
    from leyline_agent.policies import load_policies

    engines = [
        Engine(
            loaded.model,
            loaded.tokenizer,
            model_name=loaded.name,
            cache_budget_tokens=st.cache_budget_tokens,
            prefix_cache=arm != "nocache",
        )
        for arm in arms
    ]
    t0 = time.perf_counter()
    results = replay_interleaved(
        list(zip(engines, arms, strict=True)),
        trajs,
        concurrency=c,
        sessions=st.sessions,
        policies_factory=lambda: load_policies(POLICIES),
        max_turns=st.max_turns,
        max_tokens=st.max_tokens,
    )
    wall = time.perf_counter() - t0
    return [
        _row(arm, c, rep, engine, res, wall)
        for arm, engine, res in zip(arms, engines, results, strict=True)
    ]


def _row(arm: str, c: int, rep: int, engine: Any, res: Any, wall: float) -> dict[str, Any]:
    stats = engine.stats()
    sm = res.samples
    prompt = sum(s.prompt_tokens for s in sm)
    cached = sum(s.cached_tokens for s in sm)
    ttft = [s.ttft_s for s in sm]
    e2e = [s.e2e_s for s in sm]
    return {
        "arm": arm,
        "concurrency": c,
        "rep": rep,
        "requests": len(sm),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        # requests' prefill + what the directives prefilled (R for AMORTIZE, R + tail for FORGET)
        "prefilled_tokens": sum(s.prefilled_tokens for s in sm) + res.runtime.prefilled_tokens,
        "directive_prefilled_tokens": res.runtime.prefilled_tokens,
        "rotated_tokens": res.runtime.rotated_tokens,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "e2e_p50_s": percentile(e2e, 0.5),
        "e2e_p90_s": percentile(e2e, 0.9),
        "directive_s": sum(s.directive_s for s in sm),
        "splices": dict(stats.splices),
        "fallbacks": stats.fallbacks,
        "directive_errors": stats.directive_errors,
        "runtime_failures": sum(x.runtime_failures for x in res.session_stats),
        "peak_cache_tokens": res.peak_cache_tokens,
        "evicted_tokens": stats.evicted_tokens,
        "makespan_s": res.makespan_s,
        "wall_s": wall,
    }


_AGG = (
    "hit_rate",
    "prefilled_tokens",
    "ttft_p50_s",
    "ttft_p90_s",
    "e2e_p50_s",
    "e2e_p90_s",
    "peak_cache_tokens",
    "makespan_s",
)


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (arm, C): means over repetitions, ``<metric>_min`` / ``_max`` spread."""
    rows = []
    keys = list(dict.fromkeys((r["arm"], r["concurrency"]) for r in runs))
    for arm, c in keys:
        rs = [r for r in runs if r["arm"] == arm and r["concurrency"] == c]
        row: dict[str, Any] = {
            "arm": arm,
            "concurrency": c,
            "reps": len(rs),
            "requests": rs[0]["requests"],
            "prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in rs),
            "cached_tokens": statistics.fmean(r["cached_tokens"] for r in rs),
        }
        for k in _AGG:
            vals = [float(r[k]) for r in rs]
            row[k] = statistics.fmean(vals)
            row[k + "_min"], row[k + "_max"] = min(vals), max(vals)
        row["splices"] = {
            m: statistics.fmean(r["splices"].get(m, 0) for r in rs) for m in ("amortize", "forget")
        }
        row["fallbacks"] = statistics.fmean(r["fallbacks"] for r in rs)
        row["runtime_failures"] = statistics.fmean(r["runtime_failures"] for r in rs)
        rows.append(row)
    return rows


def run_mechanism(
    model_dir: Path,
    st: BenchSettings,
    out: Path,
    trajectories: Path | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from leyline_agent.engine.model.loader import load

    from ..reports.mechanism_report import write_reports

    if not Path(model_dir).is_dir():
        raise LeylineError(f"--model: no model folder at {model_dir} (leyline make-model)")
    trajs = [
        cap_messages(t, st.max_message_chars, st.max_tool_description_chars)
        for t in load_trajectories(trajectories or DEFAULT_SET)
    ]
    if not st.with_tools:
        trajs = [t.model_copy(update={"tools": []}) for t in trajs]
    loaded = load(model_dir, dtype=st.dtype, device="cpu")
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    # Untimed warm-up: the first forwards of a process pay one-off costs (allocator, kernel
    # selection per shape) that would otherwise land on whichever arm runs first.
    warm = copy.copy(st)
    warm.sessions = 1
    _run_rows(loaded, ["splice"], 1, -1, trajs, warm)
    plan = [(c, r) for r in range(st.reps) for c in st.concurrency]
    for c, rep in tqdm(plan, desc="mechanism", unit="run", disable=not progress):
        runs.extend(_run_rows(loaded, st.arms, c, rep, trajs, st))
        (out / "runs.json").write_text(json.dumps(runs, indent=1))
    rows = aggregate(runs)
    meta = {
        "model": str(model_dir),
        "settings": {k: getattr(st, k) for k in st.__slots__},
        "trajectories": str(trajectories or DEFAULT_SET),
        "policies": POLICIES,
    }
    write_reports(rows, out, meta)
    return rows


def settings_from_args(args: Any) -> BenchSettings:
    """CLI flags, then (``--config``) a YAML of ``BenchSettings`` fields over them."""
    import yaml

    cfg: dict[str, Any] = {}
    if getattr(args, "config", None) is not None:
        if not Path(args.config).is_file():
            raise LeylineError(f"--config: no such file {args.config}")
        cfg = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(cfg, dict):
            raise LeylineError(f"--config: {args.config} must hold a mapping")
    arms = cfg.pop("arms", None) or [a.strip() for a in args.arms.split(",") if a.strip()]
    st = BenchSettings.make(
        cfg.pop("concurrency", args.concurrency),
        arms,
        bool(cfg.pop("quick", args.quick)),
        cfg.pop("reps", args.reps),
        args.dtype,
    )
    for key, value in cfg.items():
        if key not in BenchSettings.__slots__:
            raise LeylineError(
                f"--config: unknown setting {key!r}; known: {', '.join(BenchSettings.__slots__)}"
            )
        setattr(st, key, value)
    return st


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder (leyline make-model)")
    p.add_argument("--concurrency", type=csv_ints, default=[1, 4, 8, 16], help="e.g. 1,4,8,16")
    p.add_argument(
        "--arms", default="full,radix,splice,forget,nocache", help="comma list of replay arms"
    )
    p.add_argument("--out", type=Path, default=Path("runs/mechanism"), help="output folder")
    p.add_argument("--quick", action="store_true", help="reduced set (~2 min on 2 cores, mini)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3, quick 1)")
    p.add_argument(
        "--trajectories",
        type=Path,
        default=None,
        help="JSONL of trajectories to replay (default: generated)",
    )
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype"
    )
    p.add_argument(
        "--config", type=Path, default=None, help="YAML settings (configs/runs/mechanism-*.yaml)"
    )


def main(args: argparse.Namespace) -> int:
    from ..reports.mechanism_report import markdown

    st = settings_from_args(args)
    rows = run_mechanism(Path(args.model), st, args.out, args.trajectories)
    print(markdown(rows))
    print(f"results: {args.out / 'results.json'}  plot: {args.out / 'results.png'}")
    return 0
