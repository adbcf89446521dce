"""``leyline bench side-by-side``: the HTTP agent replay against several servers, same model,
same trajectories, same policies, same concurrency levels.

Targets (all started here on 127.0.0.1 before the first run, stopped after the last; the
runs interleaved run by run, ``main``):

- ``vllm``: vanilla ``vllm serve`` (``.venv-vllm``), the radix arm of a production engine;
  ``vllm@32``: at block size 32 (the default is vLLM's own, 128 on CPU);
- ``vllm-leyline``: ``vllm serve`` with the Leyline plugin (``VLLM_PLUGINS=leyline``): splice;
- ``leyline``: ``leyline serve`` (the embedded engine): splice and radix.

``leyline bench http --base-url URL`` runs the same replay against any other endpoint
(llama-server: ``scripts/bench_llama_server.sh``). Every (target, arm, C) run replays fresh
histories (its sessions' first messages carry a run tag), after one untimed warm-up per
target, so no run is served what an earlier one cached beyond the shared system prompt and
tools. Outputs: ``results.json``, ``results.md`` (with splice/vanilla-vLLM ratios),
``results.png``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from leyline_agent.errors import LeylineError
from leyline_agent.launch import QUIET_AFTER_REQUEST_S, serve_leyline, serve_vllm

from ..options import csv_ints
from ..replay.http_replay import replay_http
from ..replay.trajectories import DEFAULT_SET, TrajectoryRecord, load_trajectories
from .mechanism import POLICIES, cap_messages
from .mechanism import percentile as _pct

__all__ = [
    "TARGETS", "add_arguments", "add_replay_arguments", "leyline_serve", "main", "replay_set",
    "run_target", "start_target", "write_rows",
]

TARGETS = {"vllm": ("radix",), "vllm-leyline": ("splice",), "leyline": ("splice", "radix")}
_ROOT = Path(__file__).resolve().parents[2]


def replay_set(path: Path | None, quick: bool) -> list[TrajectoryRecord]:
    """The trajectories to replay (``path``, default the shipped set); ``quick``: tool outputs
    cut to 400 characters and no tool schemas."""
    trajs = load_trajectories(path or DEFAULT_SET)
    if quick:
        trajs = [cap_messages(t, 400).model_copy(update={"tools": []}) for t in trajs]
    return trajs


def _tagged(trajs: list[TrajectoryRecord], label: str, run: int) -> list[TrajectoryRecord]:
    """``trajs`` with the run's tag in each first user message: no run is served what an
    earlier one cached beyond the shared system prompt and tools."""
    out = []
    for t in trajs:
        msgs = [dict(m) for m in t.messages]
        for m in msgs:
            if m.get("role") == "user":
                m["content"] = f"[run {label}/{run}] {m.get('content') or ''}"
                break
        out.append(t.model_copy(update={"messages": msgs}))
    return out


def _policies() -> Any:
    from leyline_agent.policies import load_policies

    return load_policies(POLICIES)


def warm_up(label: str, base_url: str, model: str, arm: str, trajs: list[TrajectoryRecord]) -> None:
    """One untimed session of two turns."""
    replay_http(base_url, model, arm, _tagged(trajs, label, -1), concurrency=1, sessions=1,
                policies_factory=_policies, max_turns=2)  # fmt: skip


def run_arm(
    label: str, base_url: str, model: str, arm: str, c: int, run: int,
    trajs: list[TrajectoryRecord], sessions: int, max_turns: int | None,
) -> dict[str, Any]:  # fmt: skip
    """One (target, arm, C) replay of ``sessions`` fresh histories: its table row."""
    res = replay_http(base_url, model, arm, _tagged(trajs, label, run), concurrency=c,
                      sessions=sessions, policies_factory=_policies, max_turns=max_turns)  # fmt: skip
    sm = res.samples
    prompt = sum(s.prompt_tokens for s in sm)
    cached = sum(s.cached_tokens for s in sm)
    ttft, e2e = [s.ttft_s for s in sm], [s.e2e_s for s in sm]
    row = {
        "server": label, "arm": arm, "concurrency": c, "sessions": sessions,
        "requests": len(sm), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "prefilled_tokens": prompt - cached + sum(s.directive_prefilled_tokens for s in sm),
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9),
        "e2e_p50_s": _pct(e2e, 0.5), "e2e_p90_s": _pct(e2e, 0.9),
        "splices": res.splices, "runtime_failures": res.failures, "wall_s": res.wall_s,
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def run_target(
    label: str, base_url: str, model: str, arms: list[str], concurrency: list[int],
    trajs: list[TrajectoryRecord], sessions: int | None, max_turns: int | None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every (arm, C) of one endpoint, after one warm-up."""
    warm_up(label, base_url, model, arms[0], trajs)
    n = sessions or max(concurrency)
    return [run_arm(label, base_url, model, arm, c, k, trajs, n, max_turns)
            for k, (c, arm) in enumerate((c, a) for c in concurrency for a in arms)]  # fmt: skip


@contextmanager
def leyline_serve(model_dir: Path, *args: str) -> Iterator[str]:
    """``leyline serve --model model_dir *args`` (``.venv``'s) on a free port, up until the
    block ends: its base URL (no ``/v1``)."""
    log = Path(tempfile.mkstemp(prefix="leyline-serve-", suffix=".log")[1])
    python = str(_ROOT / ".venv" / "bin" / "python")
    with serve_leyline(
        model_dir, "--device", "cpu", *args, python=python, log_path=log, timeout=300
    ) as srv:
        yield srv.url


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| server | arm | C | hit rate | prefilled tok | TTFT p50 / p90 s | e2e p50 / p90 s | splices | failed directives |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['server']} | {r['arm']} | {r['concurrency']} | {r['hit_rate']:.3f} | {r['prefilled_tokens']} "
        f"| {r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} | {r['e2e_p50_s']:.3f} / {r['e2e_p90_s']:.3f} "
        f"| {r['splices']} | {r['runtime_failures']} |"
        for r in sorted(rows, key=lambda r: (r["concurrency"], r["server"], r["arm"]))
    ]
    out = head + "\n".join(lines) + "\n"
    for suffix in dict.fromkeys(r["server"].partition("@")[2] for r in rows):
        at = f"@{suffix}" if suffix else ""
        base = {r["concurrency"]: r for r in rows if r["server"] == f"vllm{at}"}
        ours = {r["concurrency"]: r for r in rows if r["server"] == f"vllm-leyline{at}"}
        both = sorted(set(base) & set(ours))
        if not both:
            continue
        block = suffix or "vLLM's default"
        out += (
            f"\nvLLM + Leyline / vanilla vLLM, block size {block}:\n\n"
            "| C | prefilled: splice / vanilla vLLM | TTFT p50: splice / vanilla | e2e p50: splice / vanilla |\n|---|---|---|---|\n"
        )
        for c in both:
            b, o = base[c], ours[c]
            out += (
                f"| {c} | {o['prefilled_tokens'] / max(1, b['prefilled_tokens']):.2f} "
                f"| {o['ttft_p50_s'] / max(1e-9, b['ttft_p50_s']):.2f} "
                f"| {o['e2e_p50_s'] / max(1e-9, b['e2e_p50_s']):.2f} |\n"
            )
    ley = {(r["concurrency"], r["arm"]): r for r in rows if r["server"] == "leyline"}
    cs = sorted(c for c, a in ley if a == "splice" and (c, "radix") in ley)
    if cs:
        out += (
            "\nleyline serve, splice / radix:\n\n"
            "| C | prefilled | TTFT p50 | e2e p50 |\n|---|---|---|---|\n"
        )
        for c in cs:
            o, b = ley[(c, "splice")], ley[(c, "radix")]
            out += (
                f"| {c} | {o['prefilled_tokens'] / max(1, b['prefilled_tokens']):.2f} "
                f"| {o['ttft_p50_s'] / max(1e-9, b['ttft_p50_s']):.2f} "
                f"| {o['e2e_p50_s'] / max(1e-9, b['e2e_p50_s']):.2f} |\n"
            )
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["server"], r["arm"]) for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("hit_rate", "cache hit rate"), ("prefilled_tokens", "tokens prefilled"),
              ("ttft_p50_s", "TTFT p50 (s)"))  # fmt: skip
    for ax, (key, title) in zip(axes, panels, strict=True):
        for k, (server, arm) in enumerate(keys):
            rs = sorted((r for r in rows if (r["server"], r["arm"]) == (server, arm)),
                        key=lambda r: r["concurrency"])  # fmt: skip
            ax.plot([r["concurrency"] for r in rs], [r[key] for r in rs], marker="osD^x"[k % 5],
                    linestyle=("-", "--", "-.", ":")[k % 4], label=f"{server} {arm}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sessions in flight (C)")
        ax.set_title(title)
    axes[0].set_ylim(0, 1.02)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_rows(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    """A replay's ``results.json``, ``meta.json``, ``results.md`` and ``results.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    (out / "results.md").write_text(markdown(rows))
    plot(rows, out / "results.png")


def _target(name: str) -> tuple[str, int | None]:
    """``vllm``, ``vllm-leyline``, ``leyline``; a vLLM target may name its block size
    (``vllm@32``; default: vLLM's own, 128 on CPU)."""
    base, _, block = name.partition("@")
    if base not in TARGETS or (block and (base == "leyline" or not block.isdigit())):
        raise LeylineError(
            f"--targets: unknown {name!r}; known: {', '.join(TARGETS)} (vLLM ones may end "
            "in @<block size>)"
        )
    return base, int(block) if block else None


def start_target(stack: ExitStack, name: str, model_dir: Path) -> tuple[str, str]:
    """The target's server, up until ``stack`` closes: ``(base URL, served model)``."""
    base, block = _target(name)
    if base == "leyline":
        return stack.enter_context(leyline_serve(model_dir)) + "/v1", model_dir.name
    srv = stack.enter_context(serve_vllm(
        model_dir, leyline=base == "vllm-leyline", block_size=block, kv_cache_gib=2,
        max_model_len=8192, extra_args=["--enable-prefix-caching"],
    ))  # fmt: skip
    return srv.base_url, srv.model


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    """The replay's options, shared with ``bench http``: concurrency, sessions, turns, set."""
    p.add_argument(
        "--concurrency", type=csv_ints, default=[1, 4, 8, 16], help="comma list of C values"
    )
    p.add_argument("--sessions", type=int, default=None, help="sessions per run (default max C)")
    p.add_argument("--max-turns", type=int, default=None, help="turns per session (quick: 6)")
    p.add_argument(
        "--quick", action="store_true", help="tool outputs cut to 400 chars, no tool schemas"
    )
    p.add_argument(
        "--trajectories", type=Path, default=None, help="JSONL to replay (default: generated)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="model folder (leyline make-model), e.g. llama mini"
    )
    p.add_argument(
        "--targets", default="vllm,vllm-leyline,leyline", help="comma list of servers to compare"
    )
    add_replay_arguments(p)
    p.add_argument(
        "--count", action="store_true",
        help="print the tokens one run replays and must prefill (no server) and exit",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("runs/side-by-side"), help="output folder")


def main(args: argparse.Namespace) -> int:
    """Every target's server up at once; the runs interleaved run by run: at each C, each
    target's arms one after another, so a change of the machine's load lands on all alike.
    Between two runs a pause of ``QUIET_AFTER_REQUEST_S`` (a vLLM server just used keeps a
    core busy for about a second)."""
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise LeylineError(f"--model: no model folder at {model_dir} (leyline make-model)")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        _target(t)
    trajs = replay_set(args.trajectories, args.quick)
    max_turns = args.max_turns or (6 if args.quick else None)
    n = args.sessions or max(args.concurrency)
    if args.count:
        from ..replay.replay_counts import count, report

        counts = count(model_dir, trajs, n, max_turns, _policies)
        print(f"one run ({n} sessions): {report(counts)}")
        return 0
    rows: list[dict[str, Any]] = []
    meta = {"model": str(model_dir), "args": vars(args), "policies": POLICIES}
    with ExitStack() as stack:
        ends = {t: start_target(stack, t, model_dir) for t in targets}
        for t, (url, model) in ends.items():
            warm_up(t, url, model, TARGETS[_target(t)[0]][0], trajs)
        run = 0
        for c in args.concurrency:
            for t, (url, model) in ends.items():
                for arm in TARGETS[_target(t)[0]]:
                    time.sleep(QUIET_AFTER_REQUEST_S)
                    rows.append(run_arm(t, url, model, arm, c, run, trajs, n, max_turns))
                    run += 1
            write_rows(rows, args.out, meta)
    print(markdown(rows))
    print(f"results: {args.out / 'results.json'}  plot: {args.out / 'results.png'}")
    return 0
