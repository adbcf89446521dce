"""The harness itself: it passes a plain request and a plain 400, and it can fail.

- Over the live server: mallory's ordinary chat passes as a success, a chat with a bad
  ``max_tokens`` as a 400 naming it; asking for another field fails the check.
- ``WatchReport.problems`` flags a slow ``/health``, a long bystander gap and a watch that
  saw too little (numbers given here, not measured).
"""

from __future__ import annotations

import pytest

from leyline_agent.testing.reliability import WatchReport

CHAT = "/v1/chat/completions"


def _chat(name: str, **extra) -> dict:
    return {"model": name, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_an_ordinary_chat_passes(hostile, post, served_name):
    answer = hostile(lambda: post(CHAT, _chat(served_name, max_tokens=2)), ok=True)
    assert answer.status == 200
    assert answer.response.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_bad_field_is_a_400_naming_it(hostile, post, served_name):
    answer = hostile(lambda: post(CHAT, _chat(served_name, max_tokens=-1)), field="max_tokens")
    assert answer.status == 400
    with pytest.raises(AssertionError, match="names 'max_tokens', not 'messages'"):
        hostile(lambda: post(CHAT, _chat(served_name, max_tokens=-1)), field="messages")


def _report(**kw) -> WatchReport:
    base = dict(
        health_worst_s=0.01, health_polls=10, health_errors=[], gap_worst_s=0.05,
        tokens=20, streams=1, stream_errors=[],
    )  # fmt: skip
    return WatchReport(**{**base, **kw})


def test_the_report_flags_each_breach():
    bounds = dict(health_s=0.5, gap_s=0.5)
    assert _report().problems(**bounds) == []
    assert "/health took 0.700s" in _report(health_worst_s=0.7).problems(**bounds)[0]
    assert "worst gap 2.000s" in _report(gap_worst_s=2.0).problems(**bounds)[0]
    assert "too little watched" in _report(tokens=1).problems(**bounds)[0]
    assert "/health: HTTP 503" in _report(health_errors=["HTTP 503"]).problems(**bounds)[0]
