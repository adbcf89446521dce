"""Every route renders a conversation the same way, whatever extra keys the client sends.

The OpenAI Agents SDK marks every tool ``"strict": true``; SDK message objects dumped to
dicts carry ``refusal``, ``annotations``, ``audio``; newer clients send ``developer``
instead of ``system``. Once the chat route dropped ``strict`` and the directive route did
not: the edits fell outside the cached prefix and no splice happened. Here the expected
tokens come from the model's own tokenizer (``apply_chat_template``) on hand-written clean
messages and tools, not from the project's code.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import openai

from leyline_agent.agent.wrappers import wrap_openai

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "trajectory_10turn.json"

CLEAN_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
                "additionalProperties": False,
            },
        },
    }
]


def _strict_tools() -> list[dict]:
    tools = copy.deepcopy(CLEAN_TOOLS)
    tools[0]["function"]["strict"] = True  # what the Agents SDK sends
    tools[0]["function"]["x-vendor"] = {"any": "thing"}
    tools[0]["x-extra"] = 1
    return tools


def _noisy(messages: list[dict]) -> list[dict]:
    """``messages`` as an SDK-based agent sends them: developer role, extra keys."""
    out = []
    for m in copy.deepcopy(messages):
        if m["role"] == "system":
            m["role"] = "developer"
        if m["role"] == "assistant":
            m.update(refusal=None, annotations=[], audio=None, function_call=None)
            for c in m.get("tool_calls") or []:
                c["function"]["x-note"] = "ignored"
        m["x-trace-id"] = "abc"
        out.append(m)
    return out


def _clean(messages: list[dict]) -> list[dict]:
    return [
        {**m, "role": "system"} if m["role"] == "system" else m for m in copy.deepcopy(messages)
    ]


def _template_ids(tok, messages, tools, gen: bool) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    return tok.encode(text, add_special_tokens=False)


def test_chat_route_renders_noisy_input_like_clean_input(server, client, name, tok):
    messages = json.loads(FIXTURE.read_text())[:4]
    r = client.chat.completions.create(
        model=name, messages=_noisy(messages), tools=_strict_tools(), max_tokens=1, temperature=0
    )
    assert r.usage.prompt_tokens == len(_template_ids(tok, _clean(messages), CLEAN_TOOLS, True))


def test_directive_route_renders_noisy_input_like_clean_input(server, client, name, tok):
    messages = json.loads(FIXTURE.read_text())[:4]
    client.chat.completions.create(
        model=name, messages=_noisy(messages), tools=_strict_tools(), max_tokens=1, temperature=0
    )
    old = _noisy(messages)
    new = copy.deepcopy(old)
    new[3]["content"] = "[stub]"
    body = {"model": name, "old_messages": old, "new_messages": new, "tools": _strict_tools()}
    answer = httpx.post(f"{server.url}/leyline/v1/directives", json=body, timeout=60).json()
    clean_new = _clean(messages)
    clean_new[3]["content"] = "[stub]"
    assert answer["outcome"] == "applied", answer
    assert answer["tokens"] == _template_ids(tok, clean_new, CLEAN_TOOLS, False)


def test_wrapped_plain_openai_client_with_strict_tools_gets_splices(server, name):
    messages = _noisy(json.loads(FIXTURE.read_text()))
    before = httpx.get(f"{server.url}/leyline/v1/stats", timeout=30).json()
    base = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0)
    agent = wrap_openai(base, policies=[{"name": "stale-tool", "keep": 2}], strict=True)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in turns:
        agent.chat.completions.create(
            model=name, messages=messages[:i], tools=_strict_tools(), max_tokens=2, temperature=0
        )
    after = httpx.get(f"{server.url}/leyline/v1/stats", timeout=30).json()
    session = agent.leyline.session()
    assert session.stats.forwarded_edits >= 5
    assert session.stats.server_fallbacks == 0 and session.stats.runtime_failures == 0
    assert after["fallbacks"] == before["fallbacks"]
    assert after["splices"]["amortize"] - before["splices"]["amortize"] >= 5
