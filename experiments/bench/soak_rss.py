"""Soak: does a real ``leyline serve`` keep its resident memory flat under streaming load?

Starts ``leyline serve`` as a subprocess, then runs ``--rounds`` rounds; in each, ``--clients``
threads stream chat completions (fresh random prompts, so the cache churns) for
``--seconds``. After each round, once the server is idle, it prints the server's RSS (from
``/proc/PID/status``) and the ratio to round 1's. A plateau is a ratio near 1.

    python -m experiments.bench.soak_rss --model DIR            # 3 rounds x 64 clients x 120 s
    python -m experiments.bench.soak_rss --model DIR --rounds 3 --clients 8 --seconds 20
"""

from __future__ import annotations

import argparse
import random
import subprocess
import threading
import time
from pathlib import Path

import httpx

from leyline_agent.launch import serve_leyline

from ..options import standalone


def start_server(model: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """``leyline serve`` on a free loopback port (``launch.serve_leyline``); returns once
    ``/health`` answers."""
    srv = serve_leyline(model, *extra, timeout=300)
    return srv.process, srv.url


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory in MB, or one part of it (``RssAnon``: the anonymous pages,
    which the kernel cannot drop under memory pressure as it drops mapped files')."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


def client(url: str, model: str, seed: int, until: float, counts: list[int]) -> None:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "tool", "file", "patch", "test", "error"]
    with httpx.Client(base_url=url, timeout=300) as c:
        while time.monotonic() < until:
            text = " ".join(rng.choice(words) for _ in range(rng.randrange(20, 400)))
            body = {
                "model": model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": rng.randrange(8, 128),
                "temperature": 1.0,
                "stream": True,
            }
            try:
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass
                counts[0] += 1
            except httpx.HTTPError:
                counts[1] += 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory for leyline serve")
    p.add_argument("--rounds", type=int, default=3, help="rounds of streaming clients")
    p.add_argument("--clients", type=int, default=64, help="streaming clients per round")
    p.add_argument("--seconds", type=float, default=120.0, help="length of a round")
    p.add_argument("--serve-arg", action="append", default=[], help="extra leyline serve args")


def main(args: argparse.Namespace) -> int:
    model = Path(args.model)
    proc, url = start_server(model, *args.serve_arg)
    try:
        pid = proc.pid
        print(f"server pid {pid}: RSS at start {rss_mb(pid):.0f} MB", flush=True)
        first = None
        for k in range(1, args.rounds + 1):
            counts = [0, 0]
            until = time.monotonic() + args.seconds
            threads = [
                threading.Thread(target=client, args=(url, model.name, k * 1000 + i, until, counts))
                for i in range(args.clients)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(2.0)  # idle: the engine trims after its last request
            rss = rss_mb(pid)
            first = first or rss
            print(
                f"round {k}: {counts[0]} streams ({counts[1]} failed), RSS {rss:.0f} MB, "
                f"round_{k}/round_1 = {rss / first:.3f}",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
