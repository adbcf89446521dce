"""``/v1/messages`` and ``/v1/messages/count_tokens`` on a real ``leyline serve``, through the
real ``anthropic`` SDK.

A tiny random-weight model on loopback. The prompts a request should render are built here
independently: the chat messages the Anthropic ones stand for, rendered with the tokenizer's
own chat template. Tool loops are scripted (the model's text echoed, a scripted ``tool_use``
attached, then a long ``tool_result``), so they do not depend on what the model says.
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest

from leyline_agent.testing.messages_loops import think_loop

pytestmark = pytest.mark.slow

ARCH = "llama"
TOOL = {
    "name": "read_file",
    "description": "read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "read a file", "parameters": TOOL["input_schema"],
}}]  # fmt: skip
CLEAR_TOOLS = {"edits": [{"type": "clear_tool_uses_20250919",
                          "trigger": {"type": "input_tokens", "value": 1},
                          "keep": {"type": "tool_uses", "value": 2}}]}  # fmt: skip
BETA = ["context-management-2025-06-27"]
SERVER_KWARGS = {"client_edits": "amortize"}
GREEDY = {"temperature": 0}  # the SDK no longer takes temperature; older clients send it


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)


def rendered(tok, messages, tools=None) -> int:
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return len(out if isinstance(out, list) else out["input_ids"])


def stats(srv):
    return httpx.get(f"{srv.url}/leyline/v1/stats", timeout=60).json()


def output(k: int, salt: str) -> str:
    return " ".join(f"{salt}line{k}_{j} value={j * k}" for j in range(40))


def test_create_and_stream_agree_and_count_the_prompt(client, name, tok):
    kw = {"model": name, "max_tokens": 8, "extra_body": {"temperature": 0}, "system": "Be brief.",
          "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]}  # fmt: skip
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant"
    assert m.stop_reason in ("end_turn", "max_tokens")
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens == rendered(tok, chat)
    assert u.output_tokens <= 8
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    assert final.stop_reason == m.stop_reason
    assert final.usage.cache_read_input_tokens > 0  # the same prompt, cached by the first
    count = client.messages.count_tokens(model=name, system="Be brief.", messages=kw["messages"])
    assert count.input_tokens == rendered(tok, chat)


def test_forced_tool_use_then_tool_result(client, name, tok):
    user = {"role": "user", "content": "Read a.py"}
    m = client.messages.create(
        model=name, max_tokens=120, extra_body=GREEDY, messages=[user], tools=[TOOL],
        tool_choice={"type": "tool", "name": "read_file"},
    )  # fmt: skip
    assert m.stop_reason == "tool_use"  # the forced call fits in 120 tokens (greedy)
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "read_file" and isinstance(call.input, dict)
    call_id, args = call.id, call.input
    forced = {"type": "tool", "name": "read_file"}
    with client.messages.stream(model=name, max_tokens=120, extra_body=GREEDY, messages=[user],
                                tools=[TOOL], tool_choice=forced) as s:  # fmt: skip
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        ("tool_use", "read_file", args)
    ]
    assistant = {"role": "assistant", "content": [
        {"type": "tool_use", "id": call_id, "name": "read_file", "input": args}]}  # fmt: skip
    result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call_id, "content": "print('a')"},
        {"type": "text", "text": "Now summarise."}]}  # fmt: skip
    msgs = [user, assistant, result]
    with client.messages.stream(model=name, max_tokens=6, extra_body=GREEDY, messages=msgs,
                                tools=[TOOL]) as s:  # fmt: skip
        final = s.get_final_message()
    chat = [
        {"role": "user", "content": "Read a.py"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function",
         "function": {"name": "read_file", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "print('a')"},
        {"role": "user", "content": "Now summarise."},
    ]  # fmt: skip
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == rendered(
        tok, chat, CHAT_TOOLS
    )
    count = client.messages.count_tokens(model=name, messages=msgs, tools=[TOOL])
    assert count.input_tokens == rendered(tok, chat, CHAT_TOOLS)


def tool_loop(client, name, turns, salt, context_management=None):
    """The scripted loop; per turn (message, prefilled tokens: the prompt's uncached part
    plus what its splices prefilled)."""
    msgs = [{"role": "user", "content": f"Inspect the files {salt} and report."}]
    out = []
    for k in range(turns):
        extra = {"context_management": context_management} if context_management else {}
        m = client.beta.messages.create(
            model=name, max_tokens=4, extra_body=GREEDY, system=f"You are a careful agent {salt}.",
            messages=msgs, tools=[TOOL], betas=BETA, **extra,
        )  # fmt: skip
        spliced = sum(d.get("prefilled_tokens", 0) for d in m.model_extra["leyline"]["directives"])
        out.append((m, m.usage.input_tokens + spliced))
        text = "".join(b.text for b in m.content if b.type == "text")
        use = {"type": "tool_use", "id": f"toolu_{salt}{k}", "name": "read_file",
               "input": {"path": f"f{k}.py"}}  # fmt: skip
        result = {"type": "tool_result", "tool_use_id": use["id"], "content": output(k, salt)}
        msgs = [*msgs, {"role": "assistant", "content": [{"type": "text", "text": text}, use]},
                {"role": "user", "content": [result]}]  # fmt: skip
    return out


def test_clear_tool_uses_is_spliced_and_reported(client, server, name):
    before = stats(server)
    edited = tool_loop(client, name, 6, "e", CLEAR_TOOLS)
    after = stats(server)
    plain = tool_loop(client, name, 6, "p")
    for k, (m, _) in enumerate(edited):
        (edit,) = m.context_management.applied_edits
        assert edit.type == "clear_tool_uses_20250919"
        assert edit.cleared_tool_uses == max(0, k - 2)  # turn k holds k tool uses, keeps 2
        assert (edit.cleared_input_tokens > 0) == (k > 2)
    assert after["splices"]["amortize"] - before["splices"]["amortize"] >= 3
    total_edited = sum(p for _, p in edited)
    total_plain = sum(p for _, p in plain)
    print(f"clear_tool_uses keep 2, 6 turns: prefilled {total_edited} vs {total_plain} "
          f"unedited = {total_edited / total_plain:.3f}x")  # fmt: skip
    assert total_edited <= 1.10 * total_plain, (total_edited, total_plain)


def test_clear_thinking_is_spliced_and_reported(client, server, name, tok):
    def turn(think: str, text: str) -> dict:
        return {"role": "assistant", "content": [
            {"type": "thinking", "thinking": think, "signature": ""},
            {"type": "text", "text": text}]}  # fmt: skip

    head = [{"role": "user", "content": "Pick an option."}]
    a = turn("First I weigh options one, two and three carefully.", "Option one.")
    b = turn("Now option two looks best.", "Option two.")
    cm = {"edits": [{"type": "clear_thinking_20251015",
                     "keep": {"type": "thinking_turns", "value": 1}}]}  # fmt: skip
    first = [*head, a, {"role": "user", "content": "Sure?"}]
    client.beta.messages.create(model=name, max_tokens=3, extra_body=GREEDY, messages=first,
                                betas=BETA)  # fmt: skip
    before = stats(server)
    msgs = [*first, b, {"role": "user", "content": "Why?"}]
    m = client.beta.messages.create(model=name, max_tokens=3, extra_body=GREEDY, messages=msgs,
                                    context_management=cm, betas=BETA)  # fmt: skip
    (edit,) = m.context_management.applied_edits
    assert edit.type == "clear_thinking_20251015" and edit.cleared_thinking_turns == 1
    expected = [
        {"role": "user", "content": "Pick an option."},
        {"role": "assistant", "content": "Option one."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "<think>Now option two looks best.</think>\nOption two."},
        {"role": "user", "content": "Why?"},
    ]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == rendered(tok, expected)
    assert stats(server)["splices"]["amortize"] - before["splices"]["amortize"] >= 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0].type"),
        ({"stop_sequences": ["x"]}, "stop_sequences"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"bogus": 1}, "bogus"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919",
                                            "keep": {"type": "tool_uses", "value": 0}}]}},
         "context_management.edits[0].keep.value"),
    ],
)  # fmt: skip
def test_bad_fields_are_400_naming_them(server, name, body, field):
    base = {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{server.url}/v1/messages", json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.text


# ---- every row of docs/server.md's Messages field table ---------------------------------
# field -> (value, "ok" | "ignored" | "400"); "ok": 200 and not listed as ignored
FIELDS = {
    "model": (None, "ok"), "messages": (None, "ok"), "max_tokens": (1, "ok"),
    "system": ("Be brief.", "ok"), "stream": (False, "ok"), "temperature": (0.5, "ok"),
    "top_p": (0.9, "ok"), "top_k": (5, "ok"), "tools": ([TOOL], "ok"),
    "tool_choice": ({"type": "none"}, "ok"), "thinking": ({"type": "disabled"}, "ok"),
    "context_management": ({"edits": []}, "ok"), "leyline": ({"client_edits": "off"}, "ok"),
    "metadata": ({"user_id": "u"}, "ignored"), "service_tier": ("auto", "ignored"),
    "cache_control": ({"type": "ephemeral"}, "ignored"), "stop_sequences": (["x"], "400"),
    "container": ("c", "400"), "mcp_servers": ([], "400"), "frobnicate": (1, "400"),
}  # fmt: skip


def test_every_field_of_the_messages_table(server, name):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    section = doc.split("## Anthropic Messages API", 1)[1].split("\n## ")[0]
    rows = [ln.split("|")[1] for ln in section.splitlines() if ln.startswith("| `")]
    documented = {f for row in rows for f in re.findall(r"`([a-z_]+)", row)} - {"user_id"}
    assert documented <= set(FIELDS), documented - set(FIELDS)  # every row is sent
    base = {"model": name, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    for field, (value, want) in FIELDS.items():
        body = {**base, **({} if value is None else {field: value})}
        if field == "tool_choice":
            body["tools"] = [TOOL]
        r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
        if want == "400":
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["param"].split(".")[0] == field, (field, r.text)
            continue
        assert r.status_code == 200, (field, r.text)
        listed = [n["field"] for n in r.json().get("leyline", {}).get("ignored", [])]
        assert listed == ([f"{field}.user_id" if field == "metadata" else field]
                          if want == "ignored" else []), (field, listed)  # fmt: skip


def test_cache_control_marks_are_listed_by_path_streamed_and_counted(server, name):
    """``cache_control`` on a system block, a text block, a tool_result's block and a tool:
    each listed by its path (in ``message_delta`` when streamed; by ``count_tokens`` too),
    counted in stats."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a"}}
    mark = {"cache_control": {"type": "ephemeral"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1",
              "content": [{"type": "text", "text": "out", **mark}]}  # fmt: skip
    body = {"model": name, "max_tokens": 1, "temperature": 0,
            "system": [{"type": "text", "text": "Be brief.", **mark}],
            "tools": [{**TOOL, **mark}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", **mark}]},
                         {"role": "assistant", "content": [use]},
                         {"role": "user", "content": [result]}]}  # fmt: skip
    want = ["system[0].cache_control", "messages[0].content[0].cache_control",
            "messages[2].content[0].content[0].cache_control", "tools[0].cache_control"]  # fmt: skip
    before = stats(server)["ignored_fields"]
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert sorted(n["field"] for n in r.json()["leyline"]["ignored"]) == sorted(want)
    with httpx.stream("POST", f"{server.url}/v1/messages", json={**body, "stream": True},
                      timeout=60) as s:  # fmt: skip
        deltas = [json.loads(ln[6:]) for ln in s.iter_lines()
                  if ln.startswith("data: ") and '"message_delta"' in ln]  # fmt: skip
    (delta,) = deltas
    assert sorted(n["field"] for n in delta["leyline"]["ignored"]) == sorted(want)
    counted = {k: v for k, v in body.items() if k not in ("max_tokens", "temperature")}
    r = httpx.post(f"{server.url}/v1/messages/count_tokens", json=counted, timeout=60)
    assert r.status_code == 200, r.text
    assert sorted(n["field"] for n in r.json()["leyline"]["ignored"]) == sorted(want)
    after = stats(server)["ignored_fields"]
    key = "messages.content.cache_control"  # counted without list indices
    assert after.get(key, 0) - before.get(key, 0) == 3, (before, after)


def test_clear_thinking_loop_splices_and_prefills_like_the_unedited_loop(client, server, name):
    """``clear_thinking_20251015`` (keep 1) over 6 turns: each turn reports the thinking turns
    it cleared, each newly cleared block is spliced (AMORTIZE, at least 3), and the loop
    prefills at most 1.10x the tokens of the same loop without edits."""
    cm = {"edits": [{"type": "clear_thinking_20251015",
                     "keep": {"type": "thinking_turns", "value": 1}}]}  # fmt: skip

    def send(cm):
        return lambda msgs: client.beta.messages.create(
            model=name, max_tokens=3, extra_body=GREEDY, messages=msgs, betas=BETA,
            **({"context_management": cm} if cm else {}),
        )  # fmt: skip

    before = stats(server)["splices"]["amortize"]
    edited = think_loop(send(cm), "te")
    spliced = stats(server)["splices"]["amortize"] - before
    plain = think_loop(send(None), "tp")
    for k, (m, _) in enumerate(edited):
        (edit,) = m.context_management.applied_edits
        assert (edit.type, edit.cleared_thinking_turns) == (
            "clear_thinking_20251015",
            max(0, k - 1),
        )
    assert spliced >= 3, spliced
    total_edited, total_plain = sum(p for _, p in edited), sum(p for _, p in plain)
    print(f"clear_thinking keep 1, 6 turns: prefilled {total_edited} vs {total_plain} "
          f"unedited = {total_edited / total_plain:.3f}x, {spliced} splices")  # fmt: skip
    assert total_edited <= 1.10 * total_plain, (total_edited, total_plain)
