"""Edits that ride with a chat request on ``vllm serve`` + Leyline (``front.chat_proxy``),
over real HTTP with the real ``openai`` SDK.

- (``wrap_openai`` sending its edits this way: ``test_vllm_wrapper.py``)
- a chat request's declared edit gives the same next-token log-probs and the same cached
  rows as the same edit sent as a message-form ``POST /leyline/v1/directives`` before a
  plain chat request (the route whose exactness ``test_vllm_splice.py`` and the conformance
  suite check against transformers), and more cached rows than the edited list sent plainly;
  the answer says what came of the edit (``leyline.edits``), streamed or not;
- what this front cannot do is refused by name, and an edit with no remembered base is
  served by a re-prefill reported ``fallback: true``;
- a changed head line is one drift splice; ``context_management`` stubs stale tool results
  by a splice, and they stay stubbed (sticky) with no second splice;
- anonymous clients with the same opening get conversations of their own, and an in-place
  edit is believed only from the client that echoes the reply.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "trajectory_10turn.json"
HISTORY = json.loads(FIXTURE.read_text())
STUB = "[stale tool output removed]"


def _chat(live, messages, session=None, leyline=None, stream=False) -> httpx.Response:
    body = {"model": live.srv.model, "messages": messages, "max_tokens": 1, "temperature": 0,
            "logprobs": True, "top_logprobs": 20, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    if leyline is not None:
        body["leyline"] = leyline
    headers = {"X-Leyline-Session": session} if session else {}
    return live.client.post(live.url + "/v1/chat/completions", json=body, headers=headers)


def _answer(r: httpx.Response) -> tuple[int, list[float], dict]:
    """(cached tokens, the first token's top-20 log-probs sorted, the answer's leyline)."""
    assert r.status_code == 200, r.text
    j = r.json()
    top = j["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    cached = j["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached, sorted(t["logprob"] for t in top), j.get("leyline") or {}


def _turns() -> tuple[list[dict], list[dict], int]:
    """The first turn (up to the third tool result), the second turn (two messages more),
    and the index of the tool result the second turn stubs."""
    first = HISTORY[:8]
    second = HISTORY[:10]
    return first, second, 3


def test_a_declared_edit_is_the_directive_routes_splice(llama):
    live = llama
    first, second, k = _turns()
    edited = [dict(m) for m in second]
    edited[k] = {**edited[k], "content": STUB}
    edits = {"client_edits": "amortize", "edits": [{"index": k, "content": STUB}]}
    for s in ("ride-a", "ride-b", "ride-c"):
        _answer(_chat(live, first, s))
    # A: the edit rides with the chat request
    got = _answer(_chat(live, second, "ride-a", leyline=edits))
    # B: the same edit as a message-form directive, then the edited list plainly
    # (the conversation the cache holds: the first list, then what this turn sends after it)
    d = live.client.post(
        live.url + "/leyline/v1/directives",
        json={"old_messages": second, "new_messages": edited, "mode": "amortize"},
        headers={"X-Leyline-Session": "ride-b"},
    )  # fmt: skip
    assert d.status_code == 200 and d.json()["outcome"] == "applied", d.text
    want = _answer(_chat(live, edited, "ride-b", leyline={"client_edits": "off"}))
    # C: the edited list sent plainly (no splice: the prefix cache up to the edit)
    plain = _answer(_chat(live, edited, "ride-c", leyline={"client_edits": "off"}))

    assert got[2]["edits"] == {"declared": [k], "spliced": [k], "fallback": False}
    assert got[0] == want[0] > plain[0], (got[0], want[0], plain[0])
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) <= 1e-5


def test_the_stream_says_what_came_of_the_edits(llama):
    live = llama
    first, second, k = _turns()
    _answer(_chat(live, first, "ride-s"))
    edits = {"edits": [{"index": k, "content": STUB}]}
    r = _chat(live, second, "ride-s", leyline=edits, stream=True)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert events[0]["leyline"]["edits"] == {"declared": [k], "spliced": [k], "fallback": False}
    assert all("leyline" not in e for e in events[1:])
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_an_edit_with_no_remembered_base_is_a_reported_fallback(llama):
    live = llama
    _, second, k = _turns()
    before = live.stats()
    edits = {"edits": [{"index": k, "content": STUB}]}
    cached, _, leyline = _answer(_chat(live, second, "ride-new", leyline=edits))
    assert leyline["edits"] == {"declared": [k], "spliced": [], "fallback": True}
    assert live.stats()["splices"] == before["splices"]


def test_what_this_front_cannot_do_is_refused_by_name(llama):
    live = llama
    first, second, k = _turns()
    edits = {"edits": [{"index": k, "content": STUB}]}
    cases = [
        (dict(leyline=edits), "X-Leyline-Session"),  # no session
        (dict(session="ride-r", leyline={"edits": [{"index": 99, "content": "x"}]}),
         "leyline.edits[0].index"),
        (dict(session="ride-r", leyline={"client_edits": "off", **edits}),
         "leyline.client_edits"),
        (dict(session="ride-r", leyline={"client_edits": "sometimes"}), "leyline.client_edits"),
        (dict(session="ride-r", leyline={"mode": "x"}), "leyline.mode"),
    ]  # fmt: skip
    for kw, field in cases:
        r = _chat(live, second, **kw)
        assert r.status_code == 400, (kw, r.text)
        assert r.json()["error"]["field"] == field, (kw, r.text)
    cm = {"edits": [{"type": "clear_tool_uses_20250919"}]}
    body = {"model": live.srv.model, "messages": second, "max_tokens": 1,
            "context_management": cm, "cache_salt": "mine"}  # fmt: skip
    r = live.client.post(live.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["field"] == "cache_salt", r.text
    bad = {**body, "context_management": {"edits": [{"type": "clear_everything"}]}}
    del bad["cache_salt"]
    r = live.client.post(live.url + "/v1/chat/completions", json=bad)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == "context_management.edits[0].type", r.text
    for field, value in (("leyline", edits), ("context_management", cm)):
        r = live.client.post(live.url + "/v1/completions", json={
            "model": live.srv.model, "prompt": "hi", "max_tokens": 1, field: value})  # fmt: skip
        want = "leyline.edits" if field == "leyline" else field
        assert r.status_code == 400 and r.json()["error"]["field"] == want, r.text
    off = _chat(live, first, "ride-r", leyline={"client_edits": "off"})
    assert off.status_code == 200 and "leyline" not in off.json(), off.text


def test_a_changed_head_line_is_one_drift_splice(llama):
    """The first line of a long system prompt changes between two turns of a session: the
    front finds the drift in the rendered prompt and splices it (``leyline.drift``), so the
    turn reuses nearly all its rows; with ``client_edits`` off the same turn does not."""
    live = llama
    body = " ".join(f"rule {k}: keep the tests green." for k in range(120))
    runs = {}
    for session, opts in (("drift-on", None), ("drift-off", {"client_edits": "off"})):
        first = [{"role": "system", "content": f"Reasoning effort: high\n{body}"},
                 {"role": "user", "content": "fix the bug"}]  # fmt: skip
        reply = _chat(live, first, session, leyline=opts).json()["choices"][0]["message"]
        turn = [{"role": "system", "content": f"Reasoning effort: low\n{body}"},
                first[1], {"role": "assistant", "content": reply["content"]},
                {"role": "user", "content": "go on"}]  # fmt: skip
        r = _chat(live, turn, session, leyline=opts)
        runs[session] = (_answer(r), r.json()["usage"]["prompt_tokens"])
    (cached, _, leyline), prompt = runs["drift-on"]
    assert leyline["drift"]["spliced"] is True, leyline
    assert [s["kind"] for s in leyline["drift"]["spans"]] == ["replacement"], leyline
    assert cached >= 0.9 * prompt, (cached, prompt)
    (off, _, none), _ = runs["drift-off"]
    assert "leyline" not in none and off < prompt // 10, (off, none)
    assert live.stats()["drift_splices"] >= 1
