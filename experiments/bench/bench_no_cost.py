"""Benchmark (not a test): what the vLLM plugin costs a request that uses no directive.

    leyline bench no-cost [--model DIR] [--contexts 2048,8192]
        [--requests 40] [--rounds 2] [--pause 1.5] [--out FILE]

One ``vllm serve`` at a time, the same model and flags (``launch.serve_vllm``: fp32, eager,
prefix caching on, vLLM's default block size), once vanilla (``VLLM_PLUGINS`` empty) and
once with the plugin. The runs alternate ``rounds`` times in the order vanilla, plugin,
plugin, vanilla, ... so that a drift of the machine's load lands on both alike; each run
serves ``requests / rounds`` requests of each kind at each context.

A request is a prompt of ``c`` seeded token ids ``P`` (cached once per run, not timed)
followed by 32 fresh ones: vLLM's prefix cache hands it ``P``'s full blocks and it prefills
the rest, as a conversation's next turn does. ``c`` is a multiple of the block size by
default, so both servers prefill the same 32 tokens: with a partial last block the plugin
hands the next request the rows of ``P`` past its last full block (``held_rows``), which
vanilla vLLM prefills again, and the comparison would measure that, not the plugin's cost.
Two kinds, one after the other in each step:

- ``plain``: no session;
- ``session``: ``X-Leyline-Session`` names a session that never spliced (nothing to
  splice; vanilla vLLM ignores the header).

TTFT is the client's, from the request to the first streamed chunk (one greedy token).
Printed per context and kind: each server's p50 / p90 over every request, the plugin's p50
over vanilla's, and the mean cached prompt tokens (the same work on both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from ..options import standalone
from .bench_splice_stream import random_ids

__all__ = ["add_arguments", "main"]

SUFFIX = 32  # fresh tokens after the cached prompt
KINDS = ("plain", "session")
ARMS = ("vanilla", "plugin")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from leyline_agent.launch import QUIET_AFTER_REQUEST_S

    ap.add_argument(
        "--model", type=Path, default=None,
        help="model folder (default: llama mini, built once into the test-model cache)",
    )  # fmt: skip
    ap.add_argument("--contexts", default="2048,8192", help="comma list of cached prompt sizes")
    ap.add_argument("--requests", type=int, default=40, help="per server, context and kind")
    ap.add_argument("--rounds", type=int, default=2, help="server runs per arm (alternating)")
    ap.add_argument(
        "--pause", type=float, default=QUIET_AFTER_REQUEST_S,
        help="seconds between two requests (a vLLM server keeps a core busy after one)",
    )  # fmt: skip
    ap.add_argument(
        "--out", type=Path, default=Path("runs/no-cost/results.json"), help="the results JSON"
    )


def _ttft(c: Any, url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[float, int]:
    """Seconds to the first streamed chunk, and the prompt's cached tokens (final usage)."""
    t0 = time.perf_counter()
    first = None
    cached = -1
    with c.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            usage = json.loads(line[6:]).get("usage")
            if usage:
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if first is None:
        raise RuntimeError("the stream ended without a chunk")
    return first, cached


def _run(
    c: Any, url: str, model: str, contexts: list[int], n: int, offset: int, pause: float
) -> list[dict[str, Any]]:
    """One server's share: each context's ``P`` cached, then ``n`` steps of both kinds."""
    out = []
    for ctx in contexts:
        base = random_ids(ctx, ctx)
        body = {"model": model, "max_tokens": 1, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        for k in range(-2, n):  # two warm-up steps, not kept
            j = offset + k
            for kind in KINDS:
                h = {"X-Leyline-Session": f"no-cost-{ctx}"} if kind == "session" else {}
                prompt = base + random_ids(1_000_000 + 10 * j + (kind == "session"), SUFFIX)
                secs, cached = _ttft(c, url, {**body, "prompt": prompt}, h)
                if k >= 0:
                    out.append({"context": ctx, "kind": kind, "ttft_s": secs, "cached": cached})
                time.sleep(pause)
    return out


def main(a: argparse.Namespace) -> int:
    import httpx

    from leyline_agent.engine.checkpoints.store import model_dir
    from leyline_agent.launch import serve_vllm

    model = a.model or model_dir("llama", "mini")
    contexts = [int(x) for x in a.contexts.split(",") if x]
    per_run = -(-a.requests // a.rounds)
    rows: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    order = [arm for r in range(a.rounds) for arm in (ARMS if r % 2 == 0 else ARMS[::-1])]
    runs = {arm: 0 for arm in ARMS}
    with httpx.Client(timeout=600) as c:
        for arm in order:
            with serve_vllm(
                model, leyline=arm == "plugin", kv_cache_gib=2, max_model_len=max(contexts) + 192,
                extra_args=["--enable-prefix-caching"],
            ) as srv:  # fmt: skip
                time.sleep(a.pause)
                got = _run(c, srv.url, srv.model, contexts, per_run, runs[arm] * per_run, a.pause)
                rows[arm] += got
                runs[arm] += 1
            print(f"run {arm} {runs[arm]}/{a.rounds}: {len(got)} requests", flush=True)
    out = []
    for ctx in contexts:
        for kind in KINDS:
            p50 = {}
            for arm in ARMS:
                rs = [r for r in rows[arm] if r["context"] == ctx and r["kind"] == kind]
                secs = sorted(r["ttft_s"] for r in rs)
                p50[arm] = statistics.median(secs)
                p90 = secs[min(len(secs) - 1, int(0.9 * len(secs)))]
                cached = statistics.mean(r["cached"] for r in rs)
                out.append({"context": ctx, "kind": kind, "arm": arm, "p50_s": p50[arm],
                            "p90_s": p90, "requests": len(rs), "mean_cached": cached})  # fmt: skip
                print(f"ctx {ctx:5d} {kind:8s} {arm:8s} TTFT p50 {1000 * p50[arm]:7.1f} ms  "
                      f"p90 {1000 * p90:7.1f} ms  n {len(rs)}  cached {cached:7.1f}")  # fmt: skip
            ratio = p50["plugin"] / p50["vanilla"]
            out.append({"context": ctx, "kind": kind, "plugin_over_vanilla": ratio})
            print(f"ctx {ctx:5d} {kind:8s} plugin / vanilla p50: {ratio:.3f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"rows": out, "order": order}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
