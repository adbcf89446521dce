"""Benchmark (not a test): ``leyline serve`` under concurrent streaming clients, one run.

    leyline bench serve [--arch deepseek_v2] [--clients 1,2,4,8,16] [--context 512]
                        [--decode 64] [--reps 2] [--phases cold,cached]
                        [--concurrency N] [--torch-threads N]

Starts the real ``leyline serve`` (a child process, the ``mini`` model of ``leyline
make-model``, built once into the test-model cache) on a free loopback port. For each
client count C, C clients (threads, httpx) each stream one greedy ``/v1/completions``
with ``max_tokens=--decode``, all released together, in two phases:

- ``cold``: ``--context`` fresh random token ids each (no prefix-cache hit): the time
  includes a full prefill per client, which batching does not make cheaper.
- ``cached``: an agent's next turn. Each client's ``--context`` ids are sent once first
  (one token, not timed), so the timed request finds them cached and prefills only its 8
  new prompt tokens: the time is decode (plus a short extend).

Aggregate tokens/s = generated tokens of all clients / wall time from the release to the
last stream's end; per client the time to its first token and to its end. The row of
C = 1 is "one client alone"; every other row prints its aggregate over that one, measured
in the same run against the same server process. ``--reps`` rounds, each running every
row once (so the machine's other load falls on all rows alike); the best of the rounds
per row. Fresh ids for every run; a run in which a client met a stop token before
``--decode`` tokens is redone (up to 3 times); the table says whether all decoded.
The load average is printed before and after (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from leyline_agent.launch import serve_leyline

from ..options import csv_ints, standalone


@dataclass(slots=True)
class Run:
    clients: int
    wall_s: float
    tokens: list[int]  # generated per client
    ttft_s: list[float]
    e2e_s: list[float]

    @property
    def tps(self) -> float:
        return sum(self.tokens) / self.wall_s

    def full(self, decode: int) -> bool:
        """Every client decoded ``decode`` tokens (none met a stop token)."""
        return all(t == decode for t in self.tokens)


NEW_TURN_TOKENS = 8  # a cached-context request's own new prompt tokens




def stream_one(http, url: str, model: str, prompt: list[int], decode: int, t0: float) -> tuple:
    """One streamed completion on the client ``http`` (an ``httpx.Client``): (generated
    tokens, time to first token, time to end)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": decode, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    ttft = None
    usage = None
    with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert usage is not None, "the stream ended without usage"
    return usage["completion_tokens"], ttft or 0.0, time.perf_counter() - t0


def run_clients(url: str, model: str, prompts: list[list[int]], decode: int) -> Run:
    """The clients' streams, all released together. Each client builds its ``httpx.Client``
    before the release (an agent keeps one): building one loads an SSL context, about 50 ms
    of CPU each, which eight threads building theirs at the release would spend on the
    server's two cores inside the timed window (measured: the first request reached the
    engine 0.28 s after the release, the last 0.62 s)."""
    import httpx

    n = len(prompts)
    out: list = [None] * n
    errors: list[BaseException] = []
    t0 = [0.0]
    start = threading.Barrier(n + 1, action=lambda: t0.__setitem__(0, time.perf_counter()))

    def client(k: int) -> None:
        try:
            with httpx.Client(timeout=600) as http:
                start.wait()
                out[k] = stream_one(http, url, model, prompts[k], decode, t0[0])
        except BaseException as e:  # re-raised below
            errors.append(e)
            start.abort()  # nobody waits for a client that never reached the barrier

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    try:
        start.wait()  # every client has its connection pool: the clock starts here
    except threading.BrokenBarrierError:  # a client failed first: its error is raised below
        pass
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0[0]
    if errors:
        raise errors[0]
    return Run(n, wall, [o[0] for o in out], [o[1] for o in out], [o[2] for o in out])


@contextmanager
def leyline_serve(
    model: Path, flags: list[str], env: dict[str, str] | None, log: Path | None
) -> Iterator[str]:
    """``leyline serve --model MODEL FLAGS`` in a child process on a free loopback port
    (``launch.serve_leyline``); its base URL once ``/health`` answers. Stopped with SIGTERM
    (a clean shutdown)."""
    with serve_leyline(model, *flags, env=env, log_path=log, timeout=300) as srv:
        yield srv.url


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options (``leyline bench serve`` registers them; stdlib only at import)."""
    ap.add_argument("--arch", default="deepseek_v2", help="mini model architecture")
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: mini)")
    ap.add_argument(
        "--clients", type=csv_ints, default=[1, 2, 4, 8, 16], help="comma list of C values"
    )
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per client")
    ap.add_argument("--decode", type=int, default=64, help="max_tokens per client")
    ap.add_argument("--reps", type=int, default=2, help="runs per row (best is printed)")
    ap.add_argument("--concurrency", type=int, default=None, help="leyline serve --concurrency")
    ap.add_argument("--torch-threads", type=int, default=None, help="OMP_NUM_THREADS of the server")
    ap.add_argument("--log", type=Path, default=None, help="the server's output (default: none)")
    ap.add_argument(
        "--phases",
        default="cold,cached",
        help="cold: fresh prompts (prefill included); cached: each context cached first",
    )


def main(a: argparse.Namespace) -> int:
    if 1 not in a.clients:
        raise SystemExit("--clients: must include 1 (the one-client-alone baseline)")
    phases = [x for x in a.phases.split(",") if x]
    if not phases or set(phases) - {"cold", "cached"}:
        raise SystemExit(f"--phases: {a.phases!r}: a comma list of cold, cached")

    import httpx

    from leyline_agent.engine.checkpoints.store import model_dir

    path = a.model or model_dir(a.arch, "mini")
    flags = ["--concurrency", str(a.concurrency)] if a.concurrency else []
    env = {"OMP_NUM_THREADS": str(a.torch_threads)} if a.torch_threads else None
    print(f"load average before: {_load()} ({os.cpu_count()} cores)", flush=True)
    rng = random.Random(0)
    tables: dict[str, list[Run]] = {}
    with leyline_serve(path, flags, env, a.log) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        vocab = 5990  # inside every mini vocabulary, clear of the special ids

        def ids(n: int) -> list[int]:
            return [rng.randrange(100, vocab) for _ in range(n)]

        def prompts(c: int, phase: str) -> list[list[int]]:
            if phase == "cold":
                return [ids(a.context) for _ in range(c)]
            # an agent's next turn: the context was cached by its previous request
            contexts = [ids(a.context) for _ in range(c)]
            run_clients(url, model, contexts, 1)  # not timed
            return [ctx + ids(NEW_TURN_TOKENS) for ctx in contexts]

        run_clients(url, model, prompts(1, "cold"), 4)  # warm-up (not reported)
        # rounds: every C once per round, so the machine's other load falls on all rows alike
        runs: dict[tuple[str, int], list[Run]] = {(ph, c): [] for ph in phases for c in a.clients}
        for k in range(a.reps):
            for phase in phases:
                for c in a.clients:
                    mine = runs[(phase, c)]
                    for _ in range(3):  # a run where a client met a stop token is redone
                        mine.append(run_clients(url, model, prompts(c, phase), a.decode))
                        if mine[-1].full(a.decode):
                            break
                    print(f"  round {k + 1} {phase} C={c}: {mine[-1].tps:.1f} tok/s", flush=True)
        for phase in phases:
            tables[phase] = [
                max(runs[(phase, c)], key=lambda r: (r.full(a.decode), r.tps)) for c in a.clients
            ]
    print(f"load average after: {_load()}")
    threads = a.concurrency or "16 (default)"
    for phase, rows in tables.items():
        alone = next(r for r in rows if r.clients == 1)
        what = (
            f"{a.context}-token prompts, nothing cached (prefill included)"
            if phase == "cold"
            else f"{a.context}-token contexts cached by a previous request, "
            f"+{NEW_TURN_TOKENS} new prompt tokens"
        )
        print(
            f"\n{phase}: leyline serve --concurrency {threads}, {Path(path).name}; {what}; "
            f"{a.decode} new tokens each, streaming, best of {a.reps}"
        )
        print(
            f"| clients | tokens | all decoded {a.decode} | wall s | aggregate tok/s "
            "| vs one client | TTFT p50 s | e2e p50 s |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r.clients} | {sum(r.tokens)} | {'yes' if r.full(a.decode) else 'no'} "
                f"| {r.wall_s:.2f} "
                f"| {r.tps:.1f} | {r.tps / alone.tps:.2f}x | {_p50(r.ttft_s):.2f} "
                f"| {_p50(r.e2e_s):.2f} |"
            )
        eight = next((r for r in rows if r.clients == 8), None)
        if eight is not None:
            print(f"{phase}: 8 clients / one alone: {eight.tps / alone.tps:.2f}x aggregate tok/s")
    return 0


def _p50(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
