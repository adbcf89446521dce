"""``front.door.FrontDoor`` on vLLM's attachment (``vllm_plugin.guard.VLLM``), in process and
without vLLM: what reaches the app behind it and what it answers itself. The live checks are
``tests/vllm/test_vllm_security.py`` and ``test_vllm_chat_front.py``."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from leyline_agent.front.door import BODY_KEY, FrontDoor
from leyline_agent.http.guards import key_digests
from leyline_agent.vllm_plugin.guard import KEYS_STATE, VLLM


def _salt(session: str) -> str:
    """The session's salt, spelled out (tenant "" : ``leyline/0:/s:ID``, hashed)."""
    return "leyline-" + hashlib.sha256(f"leyline/0:/s:{session}".encode()).hexdigest()[:40]


def _call(path: str, body: bytes, headers: dict[str, str] | None = None, keys=()):
    """(status, answer body or None, what the app behind got: scope and body, or None)."""
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["scope"], seen["body"] = scope, (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    state = SimpleNamespace(**{KEYS_STATE: key_digests(keys)})
    hs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": path, "headers": hs,
             "app": SimpleNamespace(state=state)}  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    asyncio.run(FrontDoor(app, VLLM)(scope, receive, send))
    status = sent[0]["status"]
    answer = None if seen else json.loads(sent[1]["body"])
    return status, answer, seen or None


def test_a_session_header_puts_the_request_in_its_sessions_namespace():
    body = json.dumps({"prompt": "hi"}).encode()
    status, _, seen = _call("/v1/completions", body, {"X-Leyline-Session": "s1"})
    assert status == 200
    assert json.loads(seen["body"]) == {"prompt": "hi", "cache_salt": _salt("s1")}
    length = dict(seen["scope"]["headers"])[b"content-length"]
    assert int(length) == len(seen["body"])


def test_refusals_name_their_field():
    reserved = json.dumps({"prompt": "hi", "cache_salt": _salt("other")}).encode()
    status, answer, seen = _call("/v1/completions", reserved)
    assert (status, answer["error"]["param"], seen) == (400, "cache_salt", None)
    mine = json.dumps({"prompt": "hi", "cache_salt": "mine"}).encode()
    status, answer, _ = _call("/v1/completions", mine, {"X-Leyline-Session": "s1"})
    assert (status, answer["error"]["param"]) == (400, "cache_salt")
    server_made = {"X-Leyline-Session": "leyline-conv-1"}  # the server's own ids
    status, answer, _ = _call("/v1/completions", b'{"prompt":"hi"}', server_made)
    assert (status, answer["error"]["param"]) == (400, "X-Leyline-Session")
    chat_only = json.dumps({"prompt": "hi", "leyline": {"edits": []}}).encode()
    status, answer, _ = _call("/v1/completions", chat_only, {"X-Leyline-Session": "s1"})
    assert (status, answer["error"]["param"]) == (400, "leyline.edits")


def test_leyline_routes_need_the_key_and_get_their_body_parsed():
    status, answer, seen = _call("/leyline/v1/flush", b"{}", keys=["k"])
    assert (status, answer["error"]["type"], seen) == (401, "authentication_error", None)
    ok = {"Authorization": "Bearer k"}
    status, _, seen = _call("/leyline/v1/directives", b'{"a": [1]}', ok, keys=["k"])
    assert status == 200 and seen["scope"][BODY_KEY] == {"a": [1]}
    status, answer, _ = _call("/leyline/v1/directives", b'{"a": NaN}', ok, keys=["k"])
    assert (status, answer["error"]["param"]) == (400, "a")


def test_a_body_it_has_nothing_to_do_with_passes_unchanged():
    for raw in (b"not json", b"[1, 2]", b'{"prompt": "hi", "cache_salt": "mine"}'):
        status, _, seen = _call("/v1/completions", raw)
        assert status == 200 and seen["body"] == raw


def _ticking(path: str, body: bytes, headers: dict[str, str]) -> tuple[int, object, float]:
    """(status, the body the app behind got or the refusal's ``param``, the longest gap
    between ticks of another task on the door's event loop while the door read and parsed
    ``body``)."""
    seen: dict[str, Any] = {}
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    async def main() -> float:
        gaps, done = [0.0], asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        state = SimpleNamespace(**{KEYS_STATE: key_digests(())})
        hs = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        scope = {"type": "http", "method": "POST", "path": path, "headers": hs,
                 "app": SimpleNamespace(state=state)}  # fmt: skip
        await FrontDoor(app, VLLM)(scope, receive, send)
        done.set()
        await ticker
        return max(gaps)

    gap = asyncio.run(main())
    got = seen["body"] if seen else json.loads(sent[1]["body"])["error"]["param"]
    return sent[0]["status"], got, gap


@pytest.mark.timing
def test_a_body_of_millions_of_values_is_parsed_off_the_event_loop():
    """7 million numbers (14 MB, under the 16 MiB body cap): ``json.loads`` on the loop would
    hold it for about 0.4 s (timed here: the old door's stall was at least that); the door parses such a body on a thread with
    the scanner that yields the GIL and stops past ``MAX_JSON_VALUES`` (400 naming ``body``,
    on every path: vLLM would parse it on the same loop), so the loop ticks."""
    body = b'{"prompt": [' + b"0," * 7_000_000 + b'0]}'
    t0 = time.perf_counter()
    json.loads(body)
    on_loop = time.perf_counter() - t0
    bound = max(0.1, on_loop / 2)
    status, param, gap = _ticking("/leyline/v1/directives", body, {})
    assert (status, param) == (400, "body"), "a Leyline route refuses it (too many values)"
    assert gap < bound, f"the loop stalled {gap:.3f} s (json.loads alone: {on_loop:.3f} s)"
    for headers in ({"X-Leyline-Session": "s1"}, {}):  # a session's turn, a plain request
        status, param, gap = _ticking("/v1/completions", body, headers)
        assert (status, param) == (400, "body"), "refused before the engine parses it"
        assert gap < bound, f"the loop stalled {gap:.3f} s (json.loads alone: {on_loop:.3f} s)"
