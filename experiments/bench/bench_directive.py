"""Benchmark (not a test): one directive's own cost, over HTTP, on every server.

    leyline bench directive [--model DIR] [--contexts 2000,8000]
        [--repeats 6] [--targets leyline,vllm-leyline,vllm-leyline@32] [--out FILE]

Each target's server is started here on loopback (``side_by_side.start_target``: ``leyline serve``,
``vllm serve`` with the plugin at vLLM's default block size or ``@32``), all up at once, and
each gets one untimed round first (a server's first directive pays one-time set-ups). For
each context and repeat, every target in turn (so a change of the machine's load lands on
all alike, with ``QUIET_AFTER_REQUEST_S`` between two servers' requests; the turn order
rotates from one repeat to the next, since a server that runs right after another one is
measurably slower here) gets the same edit:

1. a named session caches a fresh ``T`` (seeded token ids, one completion token);
2. ``POST /leyline/v1/directives``, token form: ``T[c/2 : c/2 + c/5]`` replaced by 16 tokens
   (a stubbed tool output), AMORTIZE on one fresh ``T``, FORGET on another; the time is
   the client's, from the request to its answer;
3. the next completion of ``T' + x`` must find ``T'`` cached in full (checked, printed).

Printed per context and mode: each target's p50 / p90 and its p50 over ``leyline serve``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ..options import standalone
from .bench_splice_stream import random_ids

__all__ = ["add_arguments", "main"]

STUB = 16  # tokens of the replacement


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--model", type=Path, default=None,
        help="model folder (default: llama mini, built once into the test-model cache)",
    )  # fmt: skip
    ap.add_argument("--contexts", default="2000,8000", help="comma list of |T|")
    ap.add_argument(
        "--repeats", type=int, default=6, help="timed directives per context, mode, server"
    )
    ap.add_argument(
        "--targets", default="leyline,vllm-leyline,vllm-leyline@32",
        help="comma list of servers (bench side-by-side's targets; @N: vLLM block size)",
    )  # fmt: skip
    ap.add_argument(
        "--out", type=Path, default=Path("runs/directive/results.json"), help="the results JSON"
    )


def _once(
    c: Any, root: str, model: str, t: list[int], mode: str, session: str, quiet: float
) -> dict[str, Any]:
    """Cache ``t``, time one directive on it, check that ``T'`` is served from the cache;
    ``quiet`` seconds between two requests (a vLLM server just used keeps a core busy)."""
    h = {"X-Leyline-Session": session}
    body = {"model": model, "prompt": t, "max_tokens": 1, "temperature": 0}
    r = c.post(root + "/v1/completions", json=body, headers=h)
    r.raise_for_status()
    time.sleep(quiet)
    s = len(t) // 2
    e, rep = s + len(t) // 5, random_ids(len(t) + 7, STUB)
    d = {"start": s, "end": e, "replacement": rep, "mode": mode}
    t0 = time.perf_counter()
    r = c.post(root + "/leyline/v1/directives", json={"tokens": t, "directives": [d]}, headers=h)
    took = time.perf_counter() - t0
    r.raise_for_status()
    new = t[:s] + rep + t[e:]
    time.sleep(quiet)
    body = {"model": model, "prompt": new + [5], "max_tokens": 1, "temperature": 0}
    r = c.post(root + "/v1/completions", json=body, headers=h)
    r.raise_for_status()
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return {"seconds": took, "kept": cached == len(new)}


def main(a: argparse.Namespace) -> int:
    import httpx

    from leyline_agent.engine.checkpoints.store import model_dir
    from leyline_agent.launch import QUIET_AFTER_REQUEST_S as quiet

    from .side_by_side import start_target

    model = a.model or model_dir("llama", "mini")
    contexts = [int(x) for x in a.contexts.split(",") if x]
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    rows: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    with ExitStack() as stack, httpx.Client(timeout=600) as c:
        ends = {t: start_target(stack, t, model) for t in targets}
        for k in range(-1, a.repeats):  # k = -1: the untimed round
            turn = targets[k % len(targets) :] + targets[: k % len(targets)]
            for ctx in contexts:
                for mode in ("amortize", "forget"):
                    t = random_ids(100_000 * (k + 1) + 10 * ctx + (mode == "forget"), ctx)
                    for name in turn:
                        url, model = ends[name]
                        root = url.removesuffix("/v1")
                        session = f"bench-{name}-{k}-{ctx}-{mode}"
                        got = _once(c, root, model, t, mode, session, quiet)
                        if k >= 0:
                            rows.setdefault((ctx, mode, name), []).append(got)
                        time.sleep(quiet)
    out = []
    for (ctx, mode, name), rs in sorted(rows.items()):
        secs = sorted(r["seconds"] for r in rs)
        base = statistics.median(r["seconds"] for r in rows[(ctx, mode, targets[0])])
        p50 = statistics.median(secs)
        p90 = secs[min(len(secs) - 1, int(0.9 * len(secs)))]
        kept = sum(r["kept"] for r in rs)
        out.append({"context": ctx, "mode": mode, "target": name, "p50_s": p50, "p90_s": p90,
                    "over_first": p50 / base, "kept": kept, "repeats": len(rs)})  # fmt: skip
        print(f"ctx {ctx:6d} {mode:8s} {name:18s} p50 {1000 * p50:7.1f} ms  p90 {1000 * p90:7.1f} "
              f"ms  {p50 / base:5.2f}x {targets[0]}  T' kept in full {kept}/{len(rs)}")  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
