"""A FORGET stays forgotten: the chat request after a message-form FORGET is served exactly.

Under ``--client-edits amortize`` (``leyline serve``'s default) a client that edits a cached
tool result in place gets the edit spliced as AMORTIZE: the tail keeps the removed content in
its attention. A client that asked for a FORGET of that span first (``POST
/leyline/v1/directives``, message form, ``mode: forget``) and then sends the edited history
must get the exact answer instead: the same logprobs (within 1e-4) as a from-scratch prefill
of the same messages on an emptied cache. The AMORTIZE answer of the same edit is shown to
differ, so the comparison can tell the two apart. Real server on loopback, real ``openai``
SDK, no wrapper; the tiny model has 3 layers, so a wrong context shows in the logprobs.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from leyline_agent.testing.server import serve_in_thread

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]  # fmt: skip
STUB = "[output removed]"
SECRET = " ".join(f"secret{j}={j * 7}" for j in range(60))


@pytest.fixture(scope="module")
def srv(model_dir):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    app = create_app(Engine.from_pretrained(model_dir), client_edits="amortize")
    with serve_in_thread(app) as s:
        yield s


def _history() -> list[dict]:
    call = {"id": "call_r0", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "keys.txt"}'}}  # fmt: skip
    return [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "Read keys.txt and summarize it."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_r0", "content": SECRET},
    ]


def _chat(client: openai.OpenAI, model: str, messages: list[dict]):
    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=5,
    )  # fmt: skip
    c = r.choices[0]
    return r, c.message.content or "", [t.logprob for t in c.logprobs.content]


def _flush(srv) -> None:
    assert httpx.post(f"{srv.url}/leyline/v1/flush", timeout=60).status_code == 200


def _edited(reply: str) -> tuple[list[dict], list[dict], list[dict]]:
    """The cached list (prompt and reply), the same with the tool result stubbed, and the
    next chat request's messages (the stubbed list and a new user message)."""
    old = [*_history(), {"role": "assistant", "content": reply}]
    new = [*old[:3], {**old[3], "content": STUB}, old[4]]
    return old, new, [*new, {"role": "user", "content": "Go on."}]


def _first_turn(client, model) -> str:
    _, reply, _ = _chat(client, model, _history())
    assert reply.strip(), "the scripted echo needs a non-empty reply"
    return reply


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("session", [None, "s-forget"])
def test_message_form_forget_then_edited_chat_equals_a_fresh_prefill(srv, model_dir, session):
    name = model_dir.name
    headers = {"X-Leyline-Session": session} if session else None
    client = openai.OpenAI(
        base_url=srv.base_url, api_key="-", max_retries=0, timeout=300, default_headers=headers
    )

    # the oracle: the edited request on an emptied cache, with no conversation to continue
    _flush(srv)
    reply = _first_turn(client, name)
    _, _, nxt = _edited(reply)
    _flush(srv)
    _, fresh_text, fresh = _chat(client, name, nxt)

    # the edit sent with no directive first: the default splices it as AMORTIZE
    _flush(srv)
    assert _first_turn(client, name) == reply
    r, amortized_text, amortized = _chat(client, name, nxt)
    assert r.model_extra["leyline"]["edited_messages"] == [3]
    assert not _same(amortized, fresh) or amortized_text != fresh_text  # they can be told apart

    # FORGET first, then the same edited request: exact
    _flush(srv)
    assert _first_turn(client, name) == reply
    old, new, _ = _edited(reply)
    body = {"old_messages": old, "new_messages": new, "tools": TOOLS, "mode": "forget"}
    d = httpx.post(f"{srv.url}/leyline/v1/directives", json=body, headers=headers, timeout=300)
    assert d.status_code == 200, d.text
    assert d.json()["splices"].get("forget", 0) >= 1
    r, text, got = _chat(client, name, nxt)
    assert r.model_extra["leyline"]["edited_messages"] == []
    assert r.model_extra["leyline"]["directives"] == []
    assert text == fresh_text
    assert _same(got, fresh), (got, fresh)


def test_token_form_forget_in_a_session_keeps_its_detected_edits_exact(srv, model_dir, tok):
    """A token-form FORGET names token spans, which the server cannot map back to messages:
    the session's conversations are marked exact, so the edited chat request that follows
    is spliced as FORGET (a fresh prefill's answer), not AMORTIZE."""
    name, headers = model_dir.name, {"X-Leyline-Session": "s-token-forget"}
    client = openai.OpenAI(
        base_url=srv.base_url, api_key="-", max_retries=0, timeout=300, default_headers=headers
    )
    _flush(srv)
    reply = _first_turn(client, name)
    _, _, nxt = _edited(reply)
    _flush(srv)
    _, fresh_text, fresh = _chat(client, name, nxt)

    _flush(srv)
    assert _first_turn(client, name) == reply
    out = tok.apply_chat_template(_history(), tools=TOOLS, add_generation_prompt=True)
    cached = list(out if isinstance(out, list) else out["input_ids"])
    n = len(cached)
    body = {"tokens": cached, "directives": [
        {"start": n - 30, "end": n - 10, "replacement": cached[n - 12 : n - 10],
         "mode": "forget"}]}  # fmt: skip
    d = httpx.post(f"{srv.url}/leyline/v1/directives", json=body, headers=headers, timeout=300)
    assert d.status_code == 200, d.text
    r, text, got = _chat(client, name, nxt)
    assert r.model_extra["leyline"]["edited_messages"] == [3]
    [step] = r.model_extra["leyline"]["directives"]
    assert step["splices"]["amortize"] == 0 and step["splices"]["forget"] >= 1
    assert text == fresh_text
    assert _same(got, fresh), (got, fresh)
