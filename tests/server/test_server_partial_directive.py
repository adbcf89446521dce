"""A message-form directive is applied whole or not at all (unless it asks for ``fallback``).

Over HTTP against a real ``leyline serve`` (in a thread): a chat completion caches a tool
loop's prompt and reply; a message-form directive then edits both a cached tool result and
a message the cache has never seen. Without ``fallback`` that is a 409 naming
``old_messages`` and the cache is unchanged (the same answer and cached count as before);
with ``fallback`` the cached part is spliced and the answer says what was applied.
"""

from __future__ import annotations

import httpx
import pytest

from leyline_agent.testing.server import serve_in_thread

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def srv(model_dir):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    with serve_in_thread(create_app(Engine.from_pretrained(model_dir))) as s:
        yield s


def _messages(tail: str) -> list[dict]:
    call = {"id": "call_p0", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'}}  # fmt: skip
    return [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "Read a.txt."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_p0",
         "content": " ".join(f"row{j}={j}" for j in range(40))},  # fmt: skip
        {"role": "user", "content": tail},
    ]


def test_a_directive_past_the_cached_prefix_is_refused_whole(srv, model_dir):
    name = model_dir.name
    http = httpx.Client(base_url=srv.url, timeout=120)
    prompt = _messages("Summarize it.")[:4]
    r = http.post("/v1/chat/completions", json={
        "model": name, "messages": prompt, "tools": TOOLS, "max_tokens": 3, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    reply = {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""}
    old = [*prompt, reply, {"role": "user", "content": "never sent before " * 5}]
    new = [*old[:3], {**old[3], "content": "[elided]"}, reply, {"role": "user", "content": "x"}]
    body = {"old_messages": old, "new_messages": new, "tools": TOOLS}
    before = http.get("/leyline/v1/stats").json()
    refused = http.post("/leyline/v1/directives", json=body)
    assert refused.status_code == 409, refused.text
    assert "old_messages" in refused.json()["error"]["message"]
    after = http.get("/leyline/v1/stats").json()
    assert after["splices"] == before["splices"]
    partial = http.post("/leyline/v1/directives", json={**body, "fallback": True})
    assert partial.status_code == 200, partial.text
    assert partial.json()["splices"]["amortize"] == 1  # the cached tool result, alone
    whole = http.post("/leyline/v1/directives", json={**body, "old_messages": old[:5],
                                                      "new_messages": new[:5]})  # fmt: skip
    assert whole.status_code == 200, whole.text  # within the cached prefix: applied
