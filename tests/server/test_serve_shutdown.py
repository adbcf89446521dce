"""SIGTERM on a real ``leyline serve`` with long streams in flight: a bounded shutdown.

With ``--shutdown-timeout-s T`` the process must exit within T + 5 s of the signal, and
every stream must end cleanly: with its last token (a chunk with a ``finish_reason``) or
with one ``data: {"error": ...}`` event, then ``data: [DONE]``. The streams ask for far more
tokens than T seconds can produce, so at least one of them is still running at the deadline
(the test checks it was: otherwise it would prove nothing about the deadline).
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from leyline_agent.testing.server import serve_in_process
from leyline_agent.testing.token_ids import random_ids

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0
STREAMS = 3


def _stream(url: str, name: str, seed: int, out: dict, started: threading.Event) -> None:
    body = {
        "model": name,
        "prompt": random_ids(seed, 12),
        "max_tokens": 30000,
        "temperature": 1.0,
        "seed": seed,
        "stream": True,
    }
    events: list = []
    out[seed] = events
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            events.append(("status", r.status_code))
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                events.append(("data", data if data == "[DONE]" else json.loads(data)))
                if len(events) > 10:
                    started.set()
    except httpx.HTTPError as e:  # a stream cut without an end event
        events.append(("cut", repr(e)))
    started.set()


def _ending(events: list) -> str:
    """How a stream ended: 'error', 'last-token', or what went wrong."""
    data = [d for kind, d in events if kind == "data"]
    if not data or data[-1] != "[DONE]":
        return f"no [DONE]: {events[-3:]}"
    last = data[-2] if len(data) >= 2 else None
    if isinstance(last, dict) and "error" in last:
        return "error"
    if isinstance(last, dict) and last.get("choices", [{}])[0].get("finish_reason"):
        return "last-token"
    return f"neither: {last}"


def test_sigterm_ends_long_streams_within_the_timeout(model_dir, tmp_path):
    srv = serve_in_process(
        model_dir, "--shutdown-timeout-s", str(TIMEOUT_S), log_path=tmp_path / "serve.log"
    )
    try:
        out: dict = {}
        threads, started = [], []
        for seed in range(STREAMS):
            ev = threading.Event()
            t = threading.Thread(target=_stream, args=(srv.url, model_dir.name, seed, out, ev))
            t.start()
            threads.append(t)
            started.append(ev)
        for ev in started:
            assert ev.wait(60), "a stream did not start"
        t0 = time.monotonic()
        srv.process.send_signal(signal.SIGTERM)
        srv.process.wait(TIMEOUT_S + 30)
        exited_s = time.monotonic() - t0
        for t in threads:
            t.join(30)
    finally:
        srv.stop()
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert exited_s < TIMEOUT_S + 5, f"exited {exited_s:.1f}s after SIGTERM\n{log[-2000:]}"
    endings = [_ending(out[s]) for s in range(STREAMS)]
    assert all(e in ("error", "last-token") for e in endings), endings
    assert "error" in endings, f"no stream was still running at the deadline: {endings}"
    for s in range(STREAMS):
        errors = [
            d["error"] for k, d in out[s] if k == "data" and isinstance(d, dict) and "error" in d
        ]
        for err in errors:
            assert err["leyline_type"] == "GenerationStopped" and "shutting down" in err["message"]
