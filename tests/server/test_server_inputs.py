"""No 5xx for any input, over real HTTP: every bad value gets a 4xx JSON error naming the
field, and the same keep-alive connection answers the next request.

Bodies are sent as raw bytes where JSON escapes matter (``"\\ud800"``, ``NaN``), so what
reaches the server is exactly what a hostile client writes. The tiny-temperature answer is
checked against plain Hugging Face greedy decoding (``hf_greedy``), not against the server.
"""

from __future__ import annotations

import json

import httpx
import pytest

from leyline_agent.reference.hf_reference import hf_greedy
from leyline_agent.testing.server import serve_in_thread
from leyline_agent.testing.token_ids import random_ids

LONE = "\\ud800"  # as written in the JSON text: a lone high surrogate
DIRS = "/leyline/v1/directives"
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _raw(obj: object) -> bytes:
    """JSON text of ``obj`` in which the marker ``@LONE@`` becomes an escaped lone surrogate."""
    return json.dumps(obj).replace("@LONE@", LONE).encode("ascii")


def _post(c: httpx.Client, path: str, body: object, headers: dict | None = None) -> httpx.Response:
    data = body if isinstance(body, bytes) else _raw(body)
    return c.post(
        path, content=data, headers={"content-type": "application/json", **(headers or {})}
    )


def _surrogate_cases(name: str, T: list[int]) -> list[tuple[str, dict, str]]:
    s = "abc@LONE@def"
    user = {"role": "user", "content": "hi"}
    chat = {"model": name, "messages": [user], "max_tokens": 1}
    cmpl = {"model": name, "prompt": T[:5], "max_tokens": 1}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": s}}
    d = {"start": 1, "end": 2, "replacement": s}
    return [
        (CHAT, {**chat, "messages": [{"role": "user", "content": s}]}, "messages[0].content"),
        (CHAT, {**chat, "messages": [user, {"role": "user", "content": [{"type": "text", "text": s}]}]}, "messages[1].content[0].text"),
        (CHAT, {**chat, "messages": [user, {"role": "assistant", "content": None, "tool_calls": [call]}]}, "messages[1].tool_calls[0].function.arguments"),
        (CHAT, {**chat, "model": s}, "model"),
        (CHAT, {**chat, "stop": ["ok", s]}, "stop[1]"),
        (CHAT, {**chat, "user": s}, "user"),
        (CHAT, {**chat, "tools": [{**tool, "function": {**tool["function"], "description": s}}]}, "tools[0].function.description"),
        (CHAT, {**chat, "extra": {s: 1}}, "extra"),
        (CMPL, {**cmpl, "prompt": s}, "prompt"),
        (CMPL, {**cmpl, "prompt": [s]}, "prompt[0]"),
        (CMPL, {**cmpl, "stop": s}, "stop"),
        (DIRS, {"tokens": T, "directives": [d]}, "directives[0].replacement"),
        (DIRS, {"old_messages": [{"role": "user", "content": s}], "new_messages": [user]}, "old_messages[0].content"),
        (DIRS, {"old_messages": [user], "new_messages": [{"role": "user", "content": s}]}, "new_messages[0].content"),
        (DIRS, {"tokens": T, "directives": [], "model": s}, "model"),
        (DIRS, {"tokens": T, "directives": [], "session": s}, "session"),
        (DIRS, {"tokens": T, "directives": [], "request_id": s}, "request_id"),
    ]  # fmt: skip


def _typed_cases(name: str, T: list[int]) -> list[tuple[str, dict | bytes, int, str, str]]:
    """(path, body, status, field, error type) of strict-type, number and mode errors."""
    d = {"start": 5, "end": 8, "replacement": [7]}
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    cmpl = {"model": name, "prompt": T[:5], "max_tokens": 1}
    V, U = "ValidationError", "UnsupportedModeError"
    old = [{"role": "user", "content": "a"}]
    return [
        (DIRS, {"tokens": T, "directives": [{**d, "start": "5"}]}, 400, "directives[0].start", V),
        (DIRS, {"tokens": T, "directives": [{**d, "end": 8.0}]}, 400, "directives[0].end", V),
        (DIRS, {"tokens": T, "directives": [{**d, "end": True}]}, 400, "directives[0].end", V),
        (DIRS, {"tokens": [*T[:3], "812"], "directives": [d]}, 400, "tokens[3]", V),
        (DIRS, {"tokens": [*T[:3], 3.0], "directives": [d]}, 400, "tokens[3]", V),
        (DIRS, {"tokens": [True, *T[1:]], "directives": [d]}, 400, "tokens[0]", V),
        (DIRS, {"tokens": T, "directives": [{**d, "replacement": [7, "3"]}]}, 400, "directives[0].replacement[1]", V),
        (DIRS, {"tokens": T, "directives": [{**d, "replacement": [True]}]}, 400, "directives[0].replacement[0]", V),
        (DIRS, {"tokens": T, "directives": [d], "fallback": "true"}, 400, "fallback", V),
        (DIRS, {"tokens": T, "directives": [d], "fallback": 1}, 400, "fallback", V),
        (DIRS, {"tokens": T, "directives": [{**d, "mode": "pin"}]}, 400, "directives[0].mode", U),
        (DIRS, {"tokens": T, "directives": [{**d, "mode": "decay"}]}, 400, "directives[0].mode", U),
        (DIRS, {"tokens": T, "directives": [{**d, "mode": "SCRATCH"}]}, 400, "directives[0].mode", U),
        (DIRS, {"old_messages": old, "new_messages": old, "mode": "pin"}, 400, "mode", U),
        (DIRS, {"old_messages": old, "new_messages": old, "mode": "scratch"}, 400, "mode", U),
        (DIRS, {"old_messages": old, "new_messages": old, "mode": "decay"}, 400, "mode", U),
        (DIRS, {"old_messages": old, "new_messages": old, "mode": 1}, 400, "mode", V),
        (CMPL, {**cmpl, "seed": 2**70}, 400, "seed", "RequestError"),
        (CMPL, {**cmpl, "seed": -1}, 400, "seed", "RequestError"),
        (CMPL, {**cmpl, "seed": 2**70, "stream": True}, 400, "seed", "RequestError"),
        (CHAT, {**chat, "seed": 2**63, "stream": True}, 400, "seed", "RequestError"),
        (CMPL, {**cmpl, "seed": "1"}, 400, "seed", V),
        (CMPL, {**cmpl, "max_tokens": "3"}, 400, "max_tokens", V),
        (CMPL, {**cmpl, "stream": "true"}, 400, "stream", V),
        (CHAT, {**chat, "logprobs": 1}, 400, "logprobs", V),
        (CMPL, _raw({**cmpl, "temperature": 1}).replace(b"1}", b"NaN}"), 400, "temperature", "RequestError"),
        (CMPL, _raw({**cmpl, "top_p": 1}).replace(b"1}", b"Infinity}"), 400, "top_p", "RequestError"),
        (CHAT, _raw({**chat, "temperature": 1}).replace(b"1}", b"1e400}"), 400, "temperature", "RequestError"),
        (CMPL, {**cmpl, "temperature": 2.5}, 400, "temperature", V),
        (CMPL, {**cmpl, "prompt": "x" * 10, "max_tokens": 10**30}, 400, "max_tokens", "RequestError"),
        (CMPL, b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "body", "HTTPError"),
        (CMPL, b'{"model": "m", "prompt": ' + b"9" * 5000 + b"}", 400, "body", "HTTPError"),
        (CMPL, b"\xff\xfe{}", 400, "body[0]", V),
    ]  # fmt: skip


def _local_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("socket").getsockname()[1]


def test_lone_surrogates_in_any_text_field_are_400_naming_the_field(http, name):
    T = random_ids(301, 30)
    for path, body, field in _surrogate_cases(name, T):
        r = _post(http, path, body)
        assert r.status_code == 400, (path, field, r.text)
        err = r.json()["error"]
        assert err["leyline_type"] == "RequestError" and err["field"] == field, (field, err)
        assert "surrogate" in err["message"]


def test_strict_types_reserved_modes_and_numbers_get_4xx_naming_the_field(http, name):
    T = random_ids(302, 30)
    for path, body, status, field, type_ in _typed_cases(name, T):
        r = _post(http, path, body)
        assert r.status_code == status, (path, field, r.text[:300])
        assert r.headers["content-type"] == "application/json", r.text[:300]
        err = r.json()["error"]
        assert (err["field"], err["leyline_type"]) == (field, type_), (field, err)


def test_session_header_and_field_are_checked(http, name):
    T = random_ids(303, 20)
    body = {"tokens": T, "directives": []}
    r = _post(http, DIRS, {**body, "session": "a"}, {"X-Leyline-Session": "b"})
    assert (r.status_code, r.json()["error"]["field"]) == (400, "session")
    r = _post(http, DIRS, {**body, "session": ""})
    assert (r.status_code, r.json()["error"]["field"]) == (400, "session")
    for path in (CHAT, CMPL, DIRS):
        r = _post(http, path, {}, {"X-Leyline-Session": "x" * 300})
        assert (r.status_code, r.json()["error"]["field"]) == (400, "X-Leyline-Session"), r.text
    r = http.get("/leyline/v1/stats", headers={"X-Leyline-Session": "\x7f"})
    assert (r.status_code, r.json()["error"]["field"]) == (400, "X-Leyline-Session")


def test_a_tiny_temperature_is_greedy(client, name, model_dir, tok, stop_ids):
    ids = random_ids(304, 24)
    g = hf_greedy(model_dir, ids, 5, stop_ids)
    for t in (5e-324, 1e-300, 1e-6):
        r = client.completions.create(model=name, prompt=ids, max_tokens=5, temperature=t)
        assert r.choices[0].text == tok.decode(g.token_ids, skip_special_tokens=True), t
    r = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=5e-324
    )
    assert r.choices[0].message.content is not None


def test_the_keep_alive_connection_survives_every_error(server, name):
    """One connection: bad request, then a good one on the same socket, for every bad input."""
    T = random_ids(305, 30)
    bad: list[tuple[str, str, bytes | dict]] = [
        (p, "POST", b) for p, b, _ in _surrogate_cases(name, T)
    ]
    bad += [(p, "POST", b) for p, b, *_ in _typed_cases(name, T)]
    bad += [
        ("/nowhere", "GET", b""),
        (CMPL, "GET", b""),
        (DIRS, "POST", {"tokens": random_ids(306, 9), "directives": [{"start": 1, "end": 2}]}),
    ]
    bad += [("/v1/models", "GET", b"")]  # a good one among them
    with httpx.Client(base_url=server.url, timeout=60) as c:
        port = _local_port(c.get("/v1/models"))
        for path, method, body in bad:
            data = body if isinstance(body, bytes) else _raw(body)
            r = c.request(method, path, content=data, headers={"content-type": "application/json"})
            assert r.status_code < 500, (path, r.text[:200])
            ok = c.get("/v1/models")
            assert ok.status_code == 200
            assert _local_port(r) == _local_port(ok) == port, (
                path,
                body if isinstance(body, dict) else body[:40],
            )
    # fmt: skip


class _BrokenEngine:
    """An engine whose every call raises an unexpected error (the server is under test)."""

    model_name = "broken"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def stats(self, tenant=None):
        raise RuntimeError("boom in stats")

    def render(self, *args, **kwargs):
        raise KeyError("boom in render")

    def generate(self, *args, **kwargs):
        raise ZeroDivisionError("boom in generate")


def test_an_unexpected_exception_is_a_json_500_and_the_connection_lives(tok):
    with (
        serve_in_thread(_BrokenEngine(tok)) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        port = _local_port(c.get("/v1/models"))
        calls = [
            ("GET", "/leyline/v1/stats", None),
            ("POST", CHAT, {"model": "broken", "messages": [{"role": "user", "content": "x"}]}),
            ("POST", CMPL, {"model": "broken", "prompt": [1, 2], "max_tokens": 1}),
            ("POST", CMPL, {"model": "broken", "prompt": [1, 2], "max_tokens": 1, "stream": True}),
        ]
        for method, path, body in calls:
            r = c.request(method, path, json=body)
            if body and body.get("stream"):  # started: the error comes in-band
                assert r.status_code == 200 and '"InternalError"' in r.text, r.text
            else:
                assert r.status_code == 500, r.text
                assert (
                    r.json()["error"]["leyline_type"] == "InternalError"
                    and "boom" in r.json()["error"]["message"]
                )
            assert _local_port(r) == port
            assert c.get("/v1/models").status_code == 200
