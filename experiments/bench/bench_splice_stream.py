"""Benchmark (not a test): one session streams while another splices, on a real ``leyline serve``.

    leyline bench splice-stream [--arch deepseek_v2] [--size tiny] [--context 8192]
        [--replacement 1000] [--repeats 3] [--threads 1]

A ``leyline serve`` child process (the real command line) on a seeded random-weight model
(``leyline make-model``'s checkpoints). Session B caches ``T`` (``--context`` tokens) and
(before any stream is timed: an ordinary prefill, not paced) and then sends one AMORTIZE
over HTTP: ``T[2000:2100]`` replaced by ``--replacement`` tokens, so
``R`` is prefilled over a 2,000-token prefix and the ~6,000-row tail is moved. Session A
streams greedy completions (400 tokens each, back to back); a gap is the time between two
events of one stream, as its client receives them (its last event, which follows the
answer's cache write, included).

Each repeat runs three arms one after the other, on fresh ``T``'s, so that a change of the
machine's load falls on all three: A streams alone (2 s: its solo gaps); B splices with no
stream (the splice's time alone); B splices while A streams (A's gaps during the splice, and
the splice's time scheduled beside the stream). Printed: the solo and during gaps' p50 / p90
/ max over every repeat, their ratios (the target: within 2x), how many gaps of each exceed
2x and 3x the solo median, and the splice's time alone and scheduled (median over repeats).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

from ..options import standalone

__all__ = ["add_arguments", "gaps", "main", "stream_until"]

START, END, STREAM_TOKENS = 2000, 2100, 400


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags (stdlib only)."""
    ap.add_argument("--arch", default="deepseek_v2", help="a `leyline make-model` architecture")
    ap.add_argument("--size", default="tiny", help="tiny or mini")
    ap.add_argument("--context", type=int, default=8192, help="tokens of T (> 2100)")
    ap.add_argument("--replacement", type=int, default=1000, help="tokens of R")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the three arms")
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")


def random_ids(seed: int, n: int) -> list[int]:
    """``n`` seeded token ids inside the tiny and mini models' vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(3, 5990) for _ in range(n)]


def stream_until(c, name: str, stop: threading.Event, stamps: list[list[float]]) -> None:
    """Session A: greedy streams back to back until ``stop``; each token's arrival time,
    per stream (a gap is only ever taken inside one stream)."""
    k = 0
    while not stop.is_set():
        k += 1
        body = {"model": name, "prompt": random_ids(500 + k, 30), "max_tokens": STREAM_TOKENS,
                "temperature": 0, "stream": True}  # fmt: skip
        times: list[float] = []
        stamps.append(times)
        with c.stream("POST", "/v1/completions", json=body, headers={"X-Leyline-Session": "A"}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    times.append(time.monotonic())
                if stop.is_set():
                    break


def gaps(stamps: list[list[float]], lo: float, hi: float) -> list[float]:
    """Gaps between two tokens of one stream that overlap ``[lo, hi]``."""
    return [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b > lo and a < hi]


def _cache(c, name: str, seed: int, n_ctx: int, n_r: int):
    """Cache a fresh T as session B (its own prefill, before any stream is timed); the
    directive's ``splice()`` that times one AMORTIZE on it over HTTP (seconds)."""
    T, R = random_ids(seed, n_ctx), random_ids(seed + 1, n_r)
    body = {"model": name, "prompt": T, "max_tokens": 1, "temperature": 0}
    c.post("/v1/completions", json=body, headers={"X-Leyline-Session": "B"}).raise_for_status()
    d = {"start": START, "end": END, "replacement": R, "mode": "amortize"}

    def splice() -> float:
        t0 = time.monotonic()
        r = c.post("/leyline/v1/directives", json={"tokens": T, "directives": [d]},
                   headers={"X-Leyline-Session": "B"})  # fmt: skip
        r.raise_for_status()
        if r.json()["prefilled_tokens"] != n_r:
            raise RuntimeError(f"the splice prefilled {r.json()['prefilled_tokens']}, not {n_r}")
        return time.monotonic() - t0

    return splice


def _with_stream(c, name: str, seconds: float | None, splice=None) -> tuple[list[float], float]:
    """A streams for ``seconds`` (or through ``splice()``); its gaps over that window, and
    the splice's own time (0 without one)."""
    stop, stamps = threading.Event(), []
    th = threading.Thread(target=stream_until, args=(c, name, stop, stamps))
    th.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    took = splice() if splice is not None else (time.sleep(seconds or 0) or 0.0)
    t1 = time.monotonic()
    stop.set()
    th.join()
    return gaps(stamps, t0, t1), took


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))]


def main(a: argparse.Namespace) -> int:
    import httpx

    from leyline_agent.engine.checkpoints.store import model_dir

    from .bench_serve import leyline_serve

    if a.context <= END:
        raise SystemExit(f"--context: {a.context} must be > {END}")
    path = model_dir(a.arch, a.size)
    env = {"OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)}
    budget = str(4 * (a.context + a.replacement))
    print(f"{a.arch}-{a.size}: T {a.context} tokens, AMORTIZE [{START}, {END}) -> R of "
          f"{a.replacement} tokens; torch threads {a.threads}; {a.repeats} repeats")  # fmt: skip
    solo: list[float] = []
    during: list[float] = []
    alone_s: list[float] = []
    sched_s: list[float] = []
    with leyline_serve(path, ["--cache-tokens", budget], env, None) as url:
        with httpx.Client(base_url=url, timeout=600) as c:
            name = path.name
            _cache(c, name, 1, a.context, a.replacement)()  # warm-up: shapes, pool growth
            for k in range(a.repeats):
                solo += _with_stream(c, name, 2.0)[0]
                alone_s.append(_cache(c, name, 10 + 4 * k, a.context, a.replacement)())
                splice = _cache(c, name, 12 + 4 * k, a.context, a.replacement)
                g, took = _with_stream(c, name, None, splice)
                during += g
                sched_s.append(took)
                print(f"  repeat {k}: splice alone {alone_s[-1]:.2f} s, beside the stream "
                      f"{took:.2f} s; {len(g)} gaps during it, max {max(g) * 1e3:.1f} ms")  # fmt: skip
    rows = [("solo", solo), ("during the splice", during)]
    for label, xs in rows:
        print(f"stream gap {label}: n {len(xs)}, p50 {statistics.median(xs) * 1e3:.2f} ms, "
              f"p90 {_pct(xs, 0.9) * 1e3:.2f} ms, max {max(xs) * 1e3:.2f} ms")  # fmt: skip
    for q, f in (("p50", 0.5), ("p90", 0.9), ("max", 1.0)):
        print(f"ratio during / solo, {q}: {_pct(during, f) / _pct(solo, f):.2f}x (target < 2x)")
    p50 = statistics.median(solo)
    for k in (2, 3):
        over = sum(g > k * p50 for g in during)
        solo_over = sum(g > k * p50 for g in solo)
        print(f"gaps over {k}x the solo p50: during {over} of {len(during)} "
              f"({100 * over / len(during):.1f}%), solo {solo_over} of {len(solo)} "
              f"({100 * solo_over / len(solo):.1f}%)")  # fmt: skip
    a_s, s_s = statistics.median(alone_s), statistics.median(sched_s)
    print(f"splice: alone {a_s:.2f} s, beside the stream {s_s:.2f} s ({s_s / a_s:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
