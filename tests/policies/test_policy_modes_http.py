"""Policies choose their splice, over HTTP on a real ``leyline serve`` (tiny llama, client
edits default ``amortize``): a ``wrap_openai`` agent whose ``stale-tool`` asks for REPAIR gets
REPAIR splices (rows recomputed, counted in ``usage.leyline`` and the stats), FORGET gets
FORGET; ``leyline.edits`` with ``mode: "repair"`` splices in REPAIR; an unknown mode is a 400
naming the field."""

from __future__ import annotations

import openai
import pytest

from leyline_agent.agent.wrappers import wrap_openai

pytestmark = pytest.mark.slow

ARCH = "llama"

SERVER_KWARGS = {"client_edits": "amortize"}


@pytest.fixture(scope="module")
def arch():
    return ARCH


TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]  # fmt: skip


def _loop(client: openai.OpenAI, name: str, turns: int, tag: str) -> list[dict]:
    """A scripted tool loop (the assistant's turns written by the test): the usage.leyline
    of every turn."""
    history: list[dict] = [
        {"role": "system", "content": f"You are a careful agent ({tag})."},
        {"role": "user", "content": "Run the checks and report the counts."},
    ]
    usages = []
    for k in range(turns):
        r = client.chat.completions.create(
            model=name, messages=history, tools=TOOLS, max_tokens=3, temperature=0
        )
        usages.append(r.usage.model_extra.get("leyline") or {})
        call = {"id": f"call_{k}", "type": "function",
                "function": {"name": "run", "arguments": f'{{"n": {k}}}'}}  # fmt: skip
        history = [
            *history,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"],
             "content": f"check {k}: counted {6300 + k} rows\n" * 6},
        ]  # fmt: skip
    return usages


@pytest.mark.parametrize(
    ("knobs", "mode"),
    [({"mode": "repair", "budget": 0.1}, "repair"), ({"mode": "forget"}, "forget")],
)
def test_stale_tool_mode_reaches_the_splices(server, http, name, knobs, mode):
    plain = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    tag = f"agent-{mode}"
    policy = {"name": "stale-tool", "keep": 1, **knobs}
    client = wrap_openai(plain, policies=[policy], session_id=tag)
    before = http.get("/leyline/v1/stats").json()
    usages = _loop(client, name, 4, tag)
    session = client.leyline.session(tag)
    assert session.stats.body_edits >= 2 and session.stats.runtime_failures == 0
    spliced = [u.get("splices", {}) for u in usages]
    assert sum(s.get(mode, 0) for s in spliced) >= 2, usages
    assert sum(s.get("amortize", 0) for s in spliced) == 0, usages
    after = http.get("/leyline/v1/stats").json()
    assert after["splices"][mode] - before["splices"].get(mode, 0) >= 2
    repaired = sum(u.get("repaired_tokens", 0) for u in usages)
    if mode == "repair":
        assert repaired >= 2 and after["repaired_tokens"] - before["repaired_tokens"] == repaired
    else:
        assert repaired == 0


def _conversation(result: str) -> list[dict]:
    """A tool result answers a call by its id: only then is a changed result the same
    message edited in place (``trajectory.edited_in_place``); an id-less ``tool`` message
    edited is another conversation, served by a re-prefill with ``fallback: true``."""
    call = {"id": "call_p", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    return [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": "Run the tests."},
        {"role": "assistant", "content": "I'll run pytest.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_p", "content": result},
        {"role": "user", "content": "What failed?"},
    ]


def test_body_edits_with_mode_repair_splice_in_repair(http, name):
    """``leyline.edits`` with ``mode: "repair"``: the next turn of a named session, the
    previous reply echoed, the tool output declared edited: one REPAIR splice."""
    headers = {"X-Leyline-Session": "body-edits-repair"}
    first = _conversation("FAILED test_sum - assert 6305 == 6306\n" * 8)
    r = http.post("/v1/chat/completions", headers=headers, json={
        "model": name, "messages": first, "tools": TOOLS, "max_tokens": 2, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    reply = r.json()["choices"][0]["message"]
    nxt = [*first, {"role": "assistant", "content": reply["content"] or ""},
           {"role": "user", "content": "And the count?"}]  # fmt: skip
    edit = {"index": 3, "content": "[output of pytest removed]", "mode": "repair", "budget": 0.5}
    r = http.post("/v1/chat/completions", headers=headers, json={
        "model": name, "messages": nxt, "tools": TOOLS, "max_tokens": 2, "temperature": 0,
        "leyline": {"edits": [edit]}})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["leyline"]["edits"] == {"declared": [3], "spliced": [3], "fallback": False}, body
    usage = body["usage"]["leyline"]
    assert usage["splices"].get("repair") == 1 and usage["repaired_tokens"] >= 1, usage
    bad = {**edit, "mode": "sideways"}
    bad.pop("budget")
    r = http.post("/v1/chat/completions", headers=headers, json={
        "model": name, "messages": nxt, "tools": TOOLS, "max_tokens": 2,
        "leyline": {"edits": [bad]}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "leyline.edits[0].mode", r.text
