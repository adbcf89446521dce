"""Inputs that used to be accepted, over real HTTP: each gets a 400 naming the field.

- a user (or system) message with no content;
- a flush whose body is not JSON, or has fields the route does not take;
- a chat of more messages than ``--max-messages`` (the default, 4096): refused before it is
  validated or rendered, so a 20,000-message chat is answered in well under half a second;
- a chat whose text is surely over the prompt limit, whatever the number of messages.

What a bound lets through still works: a chat at the limit is answered, an empty-string
content is content, and a flush with no body or ``{}`` flushes.
"""

from __future__ import annotations

import time

import httpx
import pytest

from leyline_agent.engine.engine import Engine
from leyline_agent.testing.server import serve_in_thread

CHAT = "/v1/chat/completions"
DIRS = "/leyline/v1/directives"
FLUSH = "/leyline/v1/flush"
MAX_MESSAGES = 64


@pytest.fixture(scope="module")
def http(model_dir):
    engine = Engine.from_pretrained(model_dir)
    with (
        serve_in_thread(engine, max_messages=MAX_MESSAGES, max_prompt_tokens=2000) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def default_http(server):  # the default --max-messages
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _field(r: httpx.Response) -> str | None:
    return r.json()["error"]["param"]


def _chat(name: str, messages: list) -> dict:
    return {"model": name, "messages": messages, "max_tokens": 1, "temperature": 0}


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "system", "content": "s"}, {"role": "user"}], "messages[1].content"),
        ([{"role": "system"}, {"role": "user", "content": "hi"}], "messages[0].content"),
    ],
)
def test_a_message_without_content_is_refused(http, name, messages, field):
    r = http.post(CHAT, json=_chat(name, messages))
    assert r.status_code == 400, r.text
    assert _field(r) == field and "content" in r.json()["error"]["message"]


def test_a_directive_message_without_content_is_refused(http, name):
    user = {"role": "user", "content": "hi"}
    body = {"old_messages": [user], "new_messages": [{"role": "user"}], "model": name}
    r = http.post(DIRS, json=body)
    assert r.status_code == 400, r.text
    assert _field(r) == "new_messages[0].content"


def test_empty_string_content_is_content(http, name):
    r = http.post(CHAT, json=_chat(name, [{"role": "user", "content": ""}]))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [b"{not json", b'{"a": 1', b"\xff\xfe", b"[1, 2"])
def test_a_flush_with_malformed_json_is_refused(http, body):
    r = http.post(FLUSH, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert _field(r) == "body" and "JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("body", [b'{"session": "s"}', b"[]", b"null", b"3"])
def test_a_flush_with_fields_it_does_not_take_is_refused(http, body):
    r = http.post(FLUSH, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert _field(r) == "body"


@pytest.mark.parametrize("body", [b"", b"{}", b"  "])
def test_a_flush_without_fields_flushes(http, body):
    r = http.post(FLUSH, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert "flushed_tokens" in r.json()


def test_more_messages_than_the_limit_are_refused_and_the_limit_is_served(http, name):
    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": "x"} for k in range(200)]
    r = http.post(CHAT, json=_chat(name, turns[: MAX_MESSAGES + 1]))
    assert r.status_code == 400, r.text
    assert _field(r) == "messages" and str(MAX_MESSAGES) in r.json()["error"]["message"]
    ok = http.post(CHAT, json=_chat(name, turns[: MAX_MESSAGES - 1]))  # ends on a user turn
    assert ok.status_code == 200, ok.text
    body = {"old_messages": turns[:2], "new_messages": turns[: MAX_MESSAGES + 1], "model": name}
    r = http.post(DIRS, json=body)
    assert r.status_code == 400 and _field(r) == "new_messages", r.text


@pytest.mark.timing
def test_a_20000_message_chat_is_refused_fast(default_http, name):
    turns = [
        {"role": "user" if k % 2 == 0 else "assistant", "content": "hello"} for k in range(20000)
    ]
    default_http.post(CHAT, json=_chat(name, turns[:1]))  # warm the connection
    t0 = time.perf_counter()
    r = default_http.post(CHAT, json=_chat(name, turns))
    elapsed = time.perf_counter() - t0
    assert r.status_code == 400, r.text
    assert _field(r) == "messages"
    assert elapsed < 0.5, f"refused after {elapsed:.2f}s"


@pytest.mark.timing
def test_text_surely_over_the_prompt_limit_is_refused_before_rendering(http, name):
    # 40 messages of 2,000 characters: far more than 2,000 tokens can hold, whatever the
    # tokenizer's longest token (the bound is computed from it at start-up).
    turns = [{"role": "user", "content": "ab" * 1000} for _ in range(40)]
    t0 = time.perf_counter()
    r = http.post(CHAT, json=_chat(name, turns))
    assert r.status_code == 400, r.text
    assert _field(r) == "messages" and "limit" in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 0.5
