"""Hostile text over HTTP: patterns, placeholders and tags that made ``re`` backtrack, and
edit lists past their caps. Each runs on a live ``leyline serve`` while another tenant streams
and ``/health`` is polled (``hostile``, conftest).

- ``failed_call`` with ``patterns: ["(a+)+$"]`` on a 40-character result, and with
  ``placeholder: "{tool}"*10 + "!"``: answered (RE2 and a literal template scan are linear);
  a pattern RE2 cannot run (a backreference) is a 400 naming it.
- ``clear_thinking_20251015`` over 40,000 unclosed ``<think>`` tags: answered or refused for
  length, within the bound (the scan is linear; the 280 KB prompt is tokenized on the slow
  lane, ``directives/slow_lane.py``, so the other tenant's steps go on meanwhile).
- 10,000 ``context_management.edits`` / ``leyline.edits``: a 400 naming the list;
  ``leyline.edits[0].index: "3"``: a 400 naming it (no coercion).
- The policy budget itself (no server): a turn whose budget is spent is refused naming the
  edit, before any directive is planned.
"""

from __future__ import annotations

import pytest

from leyline_agent.errors import RequestError
from leyline_agent.front.context_management import parse_context_management
from leyline_agent.front.turns import plan_turn
from leyline_agent.testing.reliability import failing_call_history as _failing_history

CHAT = "/v1/chat/completions"


def _chat(name: str, messages: list[dict], **extra) -> dict:
    return {"model": name, "messages": messages, "max_tokens": 2, "temperature": 0, **extra}


def _cm(*edits: dict) -> dict:
    return {"context_management": {"edits": list(edits)}}


def test_a_nested_quantifier_on_40_characters(hostile, post, served_name):
    edit = {"type": "failed_call", "patterns": ["(a+)+$"]}
    body = _chat(served_name, _failing_history("a" * 40 + "!"), **_cm(edit))
    assert hostile(lambda: post(CHAT, body), ok=True).status == 200


def test_a_placeholder_of_ten_holes(hostile, post, served_name):
    edit = {"type": "failed_call", "placeholder": "{tool}" * 10 + "!"}
    body = _chat(
        served_name,
        _failing_history("Traceback (most recent call last)\n" + "x" * 2000),
        **_cm(edit),
    )
    answer = hostile(lambda: post(CHAT, body), ok=True)
    assert answer.status == 200
    # the stub is the placeholder with the tool's name in every hole, taken literally
    assert answer.response.json()["context_management"]["applied_edits"]


def test_a_backreference_is_refused_naming_the_pattern(hostile, post, served_name):
    edit = {"type": "failed_call", "patterns": ["Error", r"(a+)\1"]}
    body = _chat(served_name, _failing_history("aa!"), **_cm(edit))
    answer = hostile(lambda: post(CHAT, body), field="context_management.edits[0].patterns")
    assert "RE2" in answer.response.json()["error"]["message"]


def test_forty_thousand_unclosed_think_tags(hostile, post, served_name):
    messages = [
        {"role": "user", "content": "Think."},
        {"role": "assistant", "content": "<think>" * 40_000},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "<think>ok</think> Done."},
        {"role": "user", "content": "Go on."},
    ]
    body = _chat(served_name, messages, **_cm({"type": "clear_thinking_20251015"}))
    hostile(lambda: post(CHAT, body), field="messages", ok=True)


def test_ten_thousand_context_management_edits(hostile, post, served_name):
    edits = [{"type": "clear_thinking"}] * 10_000
    body = _chat(served_name, _failing_history("ok"), **_cm(*edits))
    hostile(lambda: post(CHAT, body), field="context_management.edits")


def test_ten_thousand_leyline_edits(hostile, post, served_name):
    edits = [{"index": 2, "content": "stub"}] * 10_000
    body = _chat(served_name, _failing_history("ok"), leyline={"edits": edits})
    hostile(lambda: post(CHAT, body), field="leyline.edits")


def test_a_string_index_is_refused(hostile, post, served_name):
    body = _chat(
        served_name, _failing_history("ok"), leyline={"edits": [{"index": "2", "content": "x"}]}
    )
    hostile(lambda: post(CHAT, body), field="leyline.edits[0].index")


def test_a_spent_budget_names_the_edit_and_plans_nothing():
    specs = parse_context_management(
        {"edits": [{"type": "clear_thinking"}, {"type": "failed_call"}]}, len
    )
    messages = _failing_history("error: it broke")
    with pytest.raises(RequestError) as e:
        plan_turn(messages, None, specs, "amortize", lambda ms: 10, None, budget_s=-1.0)
    assert e.value.field == "context_management.edits[0]"  # the first ran over a spent budget
