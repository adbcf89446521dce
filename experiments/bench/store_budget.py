"""The Responses store's byte budget over HTTP: does a real ``leyline serve`` keep its RSS within it?

Starts ``leyline serve`` (``soak_rss.start_server``) and stores ``--responses`` responses,
each with an ``input`` of ``--input-bytes`` bytes of text (``store`` on, 1 output token), from
``--clients`` clients, each with its own key of one tenant (a key's body bytes in flight are
bounded: ``--max-key-body-bytes``). The text is a line the tokenizer covers in few tokens,
repeated (``long_input``), so a 1 MB input is a prompt within the
model's context that the prefix cache serves after the first request. Printed, every
``--every`` responses and at the end: the server's RSS, and the tenant's
``stored_responses`` / ``stored_response_bytes`` from ``/leyline/v1/stats`` and the bytes of
the store's files on disk; then the same after ``/leyline/v1/flush`` and its
``dropped_responses``. The store's entries live on disk (``responses_store``: 256 MiB per
tenant there); what a tenant's retained requests may hold in memory is the tracked
conversations' budget (``front.conversations``: 64 MiB) plus the store's index, and the RSS
growth over the warm start (after ``--warmup`` responses and a flush) is set beside it.

    leyline bench store-budget --model DIR                     # 5,000 x 1 MB, 2 clients
    leyline bench store-budget --model DIR --responses 300 --every 100
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import httpx

from leyline_agent.front.conversations import DEFAULT_CONVERSATION_BYTES
from leyline_agent.server.responses_store import SPILL_PREFIX, StoreLimits

from ..options import standalone
from .soak_rss import rss_mb, start_server


def anon(pid: int) -> float:
    """The server's anonymous resident memory in MB: what the store and the conversations hold
    (VmRSS alone undercounts once the kernel drops the server's mapped files under pressure)."""
    return rss_mb(pid, "RssAnon")


def disk_mb(pid: int) -> float:
    """The bytes of the server's store files (its spill directory) in MiB."""
    dirs = Path(tempfile.gettempdir()).glob(f"{SPILL_PREFIX}{pid}-*")
    return sum(f.stat().st_size for d in dirs for f in d.iterdir()) / 2**20


KEYS = [f"store-budget-key-{k}" for k in range(64)]  # one per client, one tenant
_LONG_LINE = "#" + "-" * 75 + "x"  # "#---…" is one token of the test models' tokenizer


def long_input(nbytes: int) -> str:
    """``nbytes`` of ASCII text the test models' tokenizer covers in about 2 tokens per 77
    bytes: a 1 MB input is a prompt (26,000 tokens) within their 32,768-token context."""
    return (_LONG_LINE * (nbytes // len(_LONG_LINE) + 1))[:nbytes]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory for leyline serve")
    p.add_argument("--responses", type=int, default=5000, help="stored responses to create")
    p.add_argument("--input-bytes", type=int, default=1_000_000, help="input bytes per response")
    p.add_argument("--clients", type=int, default=2, help="concurrent clients")
    p.add_argument("--every", type=int, default=500, help="print the RSS every N responses")
    p.add_argument("--warmup", type=int, default=4, help="responses before the warm RSS")


def main(args: argparse.Namespace) -> int:
    model = Path(args.model)
    keys = Path(tempfile.mkdtemp(prefix="store-budget-")) / "keys.txt"
    keys.write_text("".join(f"{k} tenant\n" for k in KEYS))
    proc, url = start_server(model, "--api-key-file", str(keys))
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    text = long_input(args.input_bytes)
    budget_mb = StoreLimits().tenant_bytes / 2**20
    memory_mb = DEFAULT_CONVERSATION_BYTES / 2**20
    print(f"{args.responses} responses of {args.input_bytes} bytes of input, {args.clients} "
          f"clients; store budget {budget_mb:.0f} MiB per tenant on disk; retained in memory: "
          f"conversations {memory_mb:.0f} MiB per tenant and the store's index",
          flush=True)  # fmt: skip
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    todo = iter(range(args.responses))

    def stats(c: httpx.Client) -> str:
        s = c.get("/leyline/v1/stats").json()
        return (f"stored {s['stored_responses']}, {s['stored_response_bytes'] / 2**20:.0f} MiB, "
                f"on disk {disk_mb(proc.pid):.0f} MiB")  # fmt: skip

    def client(c: httpx.Client, n: int | None = None) -> None:
        body = {"model": model.name, "input": text, "max_output_tokens": 1, "temperature": 0}
        while True:
            with lock:
                k = next(todo, None) if n is None else (n if n > 0 else None)
            if k is None:
                return
            if n is not None:
                n -= 1
            status = c.post("/v1/responses", json=body).status_code
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
                done = sum(statuses.values())
            if n is None and done % args.every == 0:
                print(f"{done}: RSS {rss_mb(proc.pid):.0f} MB, anon {anon(proc.pid):.0f} MB, "
                      f"{stats(c)}", flush=True)  # fmt: skip

    t0 = time.monotonic()
    try:
        with httpx.Client(base_url=url, headers=auth, timeout=600) as c:
            client(c, args.warmup)  # the prefix cache and the threads warm
            c.post("/leyline/v1/flush").raise_for_status()
            time.sleep(2.0)
            statuses.clear()
            warm, warm_anon = rss_mb(proc.pid), anon(proc.pid)
            print(f"warm start (after {args.warmup} responses and a flush): RSS {warm:.0f} MB, "
                  f"anon {warm_anon:.0f} MB")  # fmt: skip
            clients = [httpx.Client(base_url=url, timeout=600,
                                    headers={"Authorization": f"Bearer {KEYS[k]}"})
                       for k in range(args.clients)]  # fmt: skip
            threads = [threading.Thread(target=client, args=(k,)) for k in clients]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            for k in clients:
                k.close()
            full, full_anon, counted = rss_mb(proc.pid), anon(proc.pid), stats(c)
            flushed = c.post("/leyline/v1/flush").json()
            time.sleep(2.0)
            after, after_anon, left = rss_mb(proc.pid), anon(proc.pid), stats(c)
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"statuses: {dict(sorted(statuses.items()))}; {time.monotonic() - t0:.0f} s")
    print(f"after the run: RSS {full:.0f} MB ({full - warm:+.0f} MB over the warm start), "
          f"anon {full_anon:.0f} MB ({full_anon - warm_anon:+.0f} MB; in-memory budget "
          f"{memory_mb:.0f} MiB + the index), {counted}")  # fmt: skip
    print(f"flush: dropped_responses {flushed.get('dropped_responses')}; RSS {after:.0f} MB "
          f"({after - warm:+.0f} MB over the warm start), anon {after_anon:.0f} MB "
          f"({after_anon - warm_anon:+.0f} MB), {left}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
