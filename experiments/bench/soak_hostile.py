"""Soak with hostile traffic: do hostile clients harm a real ``leyline serve``'s normal service?

Starts ``leyline serve`` (``soak_rss.start_server``) with two tenants (a key each: ``normal``
and ``hostile``) and runs ``--phases`` pairs of phases of ``--phase-s`` seconds, interleaved:
a quiet phase (the normal clients alone), then a hostile phase (the same normal clients,
plus as many hostile ones). Normal clients send short chats (20 to 100 words,
``max_tokens`` 8) and time each answer; hostile clients cycle through ``HOSTILE``
(regexes that backtrack, placeholders turned patterns, unclosed think tags, huge or deep schemas, 10,000 edits, a borrowed server session, a remote ``$ref``, a
stored response with a large ``metadata``, malformed JSON). Printed: every status per kind
of request with its time to answer (median and worst), the 5xx count, the normal requests' p50 / p99 in quiet and in hostile phases
and their ratio, and the server's RSS before the run, after the first quiet phase (warmed by
normal traffic alone), after the run, and after ``/leyline/v1/flush`` of both tenants (also
flushed at the end of every hostile phase: the RSS after each of those flushes shows whether
anything accumulates from cycle to cycle).

    leyline bench soak-hostile --model DIR                      # 32 clients, 10 minutes
    leyline bench soak-hostile --model DIR --clients 8 --phases 2 --phase-s 20
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from ..options import standalone
from .soak_rss import rss_mb, start_server

KEYS = {"normal": "soak-normal-key", "hostile": "soak-hostile-key"}
WORDS = ["alpha", "beta", "gamma", "delta", "tool", "file", "patch", "test", "error"]
CALL = {"id": "call_1", "type": "function", "function": {"name": "run", "arguments": "{}"}}


def _failing(result: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Run it."},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
        {"role": "assistant", "content": "It printed something."},
        {"role": "user", "content": "Go on."},
    ]


def _nested(depth: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s


def _tool(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def hostile_requests(model: str) -> dict[str, Callable[[], tuple[str, dict[str, str], Any]]]:
    """Kind -> a maker of ``(path, headers, body)``; ``body`` bytes are sent as they are."""
    chat = "/v1/chat/completions"

    def cm(messages: list[dict[str, Any]], *edits: dict[str, Any]) -> dict[str, Any]:
        return {"model": model, "messages": messages, "max_tokens": 2,
                "context_management": {"edits": list(edits)}}  # fmt: skip

    def plain(**extra: Any) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "Hi."}],
                "max_tokens": 2, **extra}  # fmt: skip

    think = [{"role": "user", "content": "Go."},
             {"role": "assistant", "content": "<think>" * 40_000 + "done"},
             {"role": "user", "content": "Again."}]  # fmt: skip
    props = {f"p{k}": {"type": "integer"} for k in range(2000)}
    schema = {"type": "object", "properties": props}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    ref = _tool("r", {"type": "object", "properties": {"a": {"$ref": "http://x.invalid/s"}}})
    return {
        "redos": lambda: (chat, {}, cm(_failing("a" * 40 + "!"),
                                       {"type": "failed_call", "patterns": ["(a+)+$"]})),
        "placeholder": lambda: (chat, {}, cm(_failing("Error: x"),
                                             {"type": "failed_call", "placeholder": "{tool}" * 10 + "!"})),
        "think-tags": lambda: (chat, {}, cm(think, {"type": "clear_thinking_20251015"})),
        "deep-tools": lambda: (chat, {}, plain(tools=[
            _tool(f"t{k}", {"type": "object", "properties": {"a": _nested(100)}}) for k in range(120)
        ])),
        "optional-2000": lambda: (chat, {}, plain(response_format=fmt)),
        "edits-10000": lambda: (chat, {}, cm(_failing("ok"), *[{"type": "clear_thinking"}] * 10_000)),
        "server-session": lambda: (chat, {"X-Leyline-Session": "leyline-conv-" + "0" * 32}, plain()),
        "remote-ref": lambda: (chat, {}, plain(tools=[ref], tool_choice="required")),
        "metadata": lambda: ("/v1/responses", {}, {
            "model": model, "input": "Hi.", "max_output_tokens": 2,
            "metadata": {f"k{k}": "v" * 1000 for k in range(100)},
        }),
        "malformed": lambda: (chat, {}, b'{"model": "x", "messages": [}'),
    }  # fmt: skip


class Tally:
    """Statuses per kind, and normal latencies per phase kind (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status: Counter[tuple[str, str]] = Counter()
        self.elapsed: dict[tuple[str, str], list[float]] = {}
        self.latency: dict[str, list[float]] = {"quiet": [], "hostile": []}

    def add(self, kind: str, status: str, phase: str | None = None, s: float = 0.0) -> None:
        with self.lock:
            self.status[(kind, status)] += 1
            self.elapsed.setdefault((kind, status), []).append(s)
            if phase is not None and status == "200":
                self.latency[phase].append(s)


def _encoded(path: str, headers: dict[str, str], body: Any) -> tuple[str, dict[str, str], bytes]:
    """The request with its body encoded once: the client's JSON work is not redone per send
    (it would hold this process's GIL, and the normal clients' timings with it)."""
    return path, headers, body if isinstance(body, bytes) else json.dumps(body).encode()


def _send(c: httpx.Client, path: str, headers: dict[str, str], body: Any) -> str:
    try:
        if isinstance(body, bytes):
            headers = {**headers, "Content-Type": "application/json"}
            r = c.post(path, content=body, headers=headers)
        else:
            r = c.post(path, json=body, headers=headers)
        return str(r.status_code)
    except httpx.HTTPError as e:
        return type(e).__name__


def normal_client(
    url: str, model: str, seed: int, phase: list[str], until: float, t: Tally
) -> None:
    rng = random.Random(seed)
    auth = {"Authorization": f"Bearer {KEYS['normal']}"}
    with httpx.Client(base_url=url, timeout=300, headers=auth) as c:
        while time.monotonic() < until:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(20, 100)))
            body = {"model": model, "messages": [{"role": "user", "content": text}],
                    "max_tokens": 8, "temperature": 0}  # fmt: skip
            now, t0 = phase[0], time.perf_counter()
            status = _send(c, "/v1/chat/completions", {}, body)
            if phase[0] == now:  # an answer that spans two phases is counted in neither
                t.add("normal", status, now, time.perf_counter() - t0)


def hostile_client(url: str, seed: int, phase: list[str], until: float, t: Tally,
                   kinds: dict[str, Callable[[], tuple[str, dict[str, str], Any]]]) -> None:  # fmt: skip
    auth = {"Authorization": f"Bearer {KEYS['hostile']}"}
    order = list(kinds)
    random.Random(seed).shuffle(order)
    sent = {kind: _encoded(*kinds[kind]()) for kind in order}  # as an attacker replays them
    with httpx.Client(base_url=url, timeout=300, headers=auth) as c:
        for kind in itertools.cycle(order):
            if time.monotonic() >= until:
                return
            if phase[0] != "hostile":
                time.sleep(0.2)
                continue
            path, headers, body = sent[kind]
            t0 = time.perf_counter()
            status = _send(c, path, headers, body)
            t.add(kind, status, s=time.perf_counter() - t0)


def _flush(url: str) -> None:
    for key in KEYS.values():
        httpx.post(f"{url}/leyline/v1/flush", headers={"Authorization": f"Bearer {key}"},
                   timeout=60).raise_for_status()  # fmt: skip


def _p(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else float("nan")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory for leyline serve")
    p.add_argument("--clients", type=int, default=32, help="normal + hostile (half each)")
    p.add_argument("--phases", type=int, default=5, help="quiet/hostile pairs")
    p.add_argument("--phase-s", type=float, default=60.0, help="seconds of each phase")
    p.add_argument("--serve-arg", action="append", default=[], help="extra leyline serve args")


def main(args: argparse.Namespace) -> int:
    model = Path(args.model)
    keys = Path(tempfile.mkdtemp(prefix="soak-hostile-")) / "keys.txt"
    keys.write_text("".join(f"{k} {tenant}\n" for tenant, k in KEYS.items()))
    proc, url = start_server(model, "--api-key-file", str(keys), *args.serve_arg)
    half = max(1, args.clients // 2)
    print(f"{half} normal + {half} hostile clients, {args.phases} x (quiet {args.phase_s:g} s, "
          f"hostile {args.phase_s:g} s), interleaved", flush=True)  # fmt: skip
    try:
        rss_start = rss_mb(proc.pid)
        tally, phase = Tally(), ["quiet"]
        until = time.monotonic() + 2 * args.phases * args.phase_s
        kinds = hostile_requests(model.name)
        threads = [
            threading.Thread(target=normal_client, args=(url, model.name, i, phase, until, tally))
            for i in range(half)
        ] + [
            threading.Thread(target=hostile_client, args=(url, 1000 + i, phase, until, tally, kinds))
            for i in range(half)
        ]  # fmt: skip
        for th in threads:
            th.start()
        rss_cycles = []  # after each hostile phase's flush: flat if nothing accumulates
        rss_warm = float("nan")
        for k in range(2 * args.phases):
            phase[0] = ("quiet", "hostile")[k % 2]
            time.sleep(max(0.0, min(args.phase_s, until - time.monotonic())))
            if k == 0:  # the server warmed by normal traffic alone: what a flush comes back to
                rss_warm = rss_mb(proc.pid)
            if k % 2 and k < 2 * args.phases - 1:
                _flush(url)
                rss_cycles.append(rss_mb(proc.pid))
        for th in threads:
            th.join()
        time.sleep(2.0)  # idle: the engine trims after its last request
        rss_after = rss_mb(proc.pid)
        _flush(url)
        time.sleep(2.0)
        rss_flushed = rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    print("| request | status | count | median s | worst s |\n|---|---|---|---|---|")
    for (kind, status), n in sorted(tally.status.items()):
        xs = tally.elapsed[(kind, status)]
        print(f"| {kind} | {status} | {n} | {statistics.median(xs):.3f} | {max(xs):.3f} |")
    fives = sum(n for (_, s), n in tally.status.items() if s.startswith("5"))
    failed = sum(n for (_, s), n in tally.status.items() if not s[0].isdigit())
    print(f"5xx answers: {fives}; requests without an answer: {failed}")
    q, h = tally.latency["quiet"], tally.latency["hostile"]
    print("| normal chats | answered | p50 s | p99 s |\n|---|---|---|---|")
    for name, xs in (("quiet phases", q), ("hostile phases", h)):
        print(f"| {name} | {len(xs)} | {_p(xs, 50):.3f} | {_p(xs, 99):.3f} |")
    print(f"normal p99 hostile / quiet = {_p(h, 99) / _p(q, 99):.2f}x; "
          f"p50 = {_p(h, 50) / _p(q, 50):.2f}x")  # fmt: skip
    print(f"RSS: start {rss_start:.0f} MB, after the first quiet phase {rss_warm:.0f} MB, "
          f"after the run {rss_after:.0f} MB, after flush {rss_flushed:.0f} MB")  # fmt: skip
    cycles = [*rss_cycles, rss_flushed]
    print("RSS after each hostile phase's flush: " + ", ".join(f"{x:.0f}" for x in cycles)
          + " MB")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
