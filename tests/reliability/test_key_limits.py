"""Per-key limits on work in flight (``server/key_limits.py``), over HTTP on a live server.

A request is held in flight from outside: a raw socket sends its headers (with a declared
``Content-Length``) and part of its body, and waits. While it is held:

- another body from the same key that would pass ``--max-key-body-bytes`` gets 429 with
  ``Retry-After``, and a message naming the flag, before the server reads that body (the
  client sends only the headers and reads the answer);
- a request past ``--max-key-requests`` gets 429 naming that flag;
- the other tenant's requests, and the same tenant's other key, are answered as usual.

Once the held request's client goes away, its key is admitted again.

A key whose requests are refused (4xx) past its burst is paced at ``--max-key-refusals-per-s``:
its next requests wait their turn, one at a time, and still get their own answer (the 400
naming the field); the same tenant's other key and the other tenant are not paced.
"""

from __future__ import annotations

import socket
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

from leyline_agent.server.key_limits import REFUSAL_BURST_S
from leyline_agent.testing.reliability import ALICE, MALLORY, MALLORY_2

MAX_REQUESTS = 3
MAX_BODY_BYTES = 100_000
REFUSALS_PER_S = 4.0
SERVER_ARGS = (
    "--max-key-requests", str(MAX_REQUESTS), "--max-key-body-bytes", str(MAX_BODY_BYTES),
    "--max-key-refusals-per-s", str(REFUSALS_PER_S),
)  # fmt: skip
CHAT = "/v1/chat/completions"


@contextmanager
def held(url: str, key: str, size: int):
    """A chat request of ``size`` declared bytes whose body never finishes arriving."""
    parts = urlsplit(url)
    s = socket.create_connection((parts.hostname, parts.port), timeout=30)
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    )
    s.sendall(head.encode() + b'{"model": ')
    try:
        yield s
    finally:
        s.close()


def headers_only(url: str, key: str, size: int) -> tuple[int, dict[str, str], str]:
    """Send a request's headers and no body byte; the status, headers and body answered."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as s:
        s.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode()
        )
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in fields.items()}, body.decode()


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _chat(name: str) -> dict:
    return {"model": name, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}


def _admitted(http, as_key, name: str, key: str) -> int:
    """The status of a small chat from ``key``, retried while it is 429 (at most 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        r = http.post(CHAT, json=_chat(name), headers=as_key(key))
        if r.status_code != 429 or time.monotonic() > deadline:
            return r.status_code
        time.sleep(0.1)


def test_a_key_over_its_body_bytes_gets_429_before_its_body_is_read(
    live, http, as_key, served_name
):
    with held(live.url, MALLORY, 80_000):
        time.sleep(0.3)  # the held request has reached the server
        status, headers, body = headers_only(live.url, MALLORY, 30_000)
        assert status == 429, body
        assert headers["retry-after"] == "1"
        assert "--max-key-body-bytes" in body and str(MAX_BODY_BYTES) in body
        small = http.post(CHAT, json=_chat(served_name), headers=as_key(MALLORY))
        assert small.status_code == 200, small.text  # within the bytes left
        for key in (MALLORY_2, ALICE):  # another key, of this tenant or another
            assert http.post(CHAT, json=_chat(served_name), headers=as_key(key)).status_code == 200
    assert _admitted(http, as_key, served_name, MALLORY) == 200


def test_a_key_over_its_requests_in_flight_gets_429(live, http, as_key, served_name):
    with held(live.url, MALLORY, 99), held(live.url, MALLORY, 99), held(live.url, MALLORY, 99):
        time.sleep(0.3)
        r = http.post(CHAT, json=_chat(served_name), headers=as_key(MALLORY))
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert "--max-key-requests" in r.json()["error"]["message"]
        assert http.post(CHAT, json=_chat(served_name), headers=as_key(ALICE)).status_code == 200
    assert _admitted(http, as_key, served_name, MALLORY) == 200


def test_a_key_refused_past_its_burst_is_paced_and_other_keys_are_not(
    live, http, as_key, served_name
):
    """Runs last: it leaves ``MALLORY_2`` paced for a few seconds."""
    bad = b'{"model": "x", "messages": [}'

    def refused(key: str) -> float:
        t = time.monotonic()
        headers = {**as_key(key), "Content-Type": "application/json"}
        r = http.post(CHAT, content=bad, headers=headers)
        assert r.status_code == 400, r.text  # its own answer, not a 429
        return time.monotonic() - t

    burst, more = int(REFUSALS_PER_S * REFUSAL_BURST_S), 8
    took = sum(refused(MALLORY_2) for _ in range(burst + more))
    # at most burst + rate * took refusals in took seconds (one more for the last refill)
    assert took >= (more - 1) / REFUSALS_PER_S - 0.05, took
    t = time.monotonic()  # the same tenant's other key and the other tenant: not paced
    assert http.post(CHAT, json=_chat(served_name), headers=as_key(MALLORY)).status_code == 200
    assert http.post(CHAT, json=_chat(served_name), headers=as_key(ALICE)).status_code == 200
    refused(ALICE)
    assert time.monotonic() - t < 30
