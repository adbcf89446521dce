"""The one session registry of ``wrap_openai`` and ``LeylineTransport``: found by content,
named, bounded (least recently used first, never a session with a call in flight)."""

from __future__ import annotations

import openai

from leyline_agent import LeylineTransport, leyline_state, wrap_openai
from leyline_agent.agent.registry import SessionRegistry
from leyline_agent.agent.session import ContextSession


def _registry(**bounds) -> SessionRegistry:
    return SessionRegistry(lambda sid: ContextSession([], None, session_id=sid), **bounds)


def _turn(session: ContextSession, messages: list[dict]) -> list[dict]:
    """One answered turn of ``session``; returns the history the agent sends next."""
    session.prepare(messages)
    reply = {"role": "assistant", "content": f"answer to {len(messages)}"}
    session.observe_reply(reply)
    return [*messages, reply, {"role": "user", "content": "and then?"}]


def test_a_conversation_is_found_again_by_its_content():
    reg = _registry()
    a = reg.by_content([{"role": "user", "content": "A"}], first_id="default")
    assert a.session_id == "default"
    next_a = _turn(a, [{"role": "user", "content": "A"}])
    reg.release(a)
    b = reg.by_content([{"role": "user", "content": "B"}], first_id="default")
    assert b is not a and b.session_id != "default"  # the first id is taken
    assert reg.by_content(next_a) is a
    assert reg.by_content(next_a) is not a  # a is busy: a concurrent call gets its own
    reg.release(a)


def test_sessions_found_by_content_are_bounded_least_recently_used_first():
    reg = _registry(max_found=4)
    kept = []
    for k in range(10):
        s = reg.by_content([{"role": "user", "content": f"task {k}"}])
        kept.append(_turn(s, [{"role": "user", "content": f"task {k}"}]))
        reg.release(s)
    assert len(reg.sessions()) == 4
    assert reg.by_content(kept[-1]).session_id in {s.session_id for s in reg.sessions()}
    busy = [reg.by_content([{"role": "user", "content": f"busy {k}"}]) for k in range(6)]
    assert len(reg.sessions()) >= 6  # a session with a call in flight is never dropped
    for s in busy:
        reg.release(s)
    reg.release(reg.by_content([{"role": "user", "content": "one more"}]))
    assert len(reg.sessions()) == 4


def test_named_sessions_are_bounded_and_one_id_is_one_session():
    reg = _registry(max_named=3)
    found = reg.by_content([{"role": "user", "content": "x"}], first_id="default")
    reg.release(found)
    assert reg.named("default") is found  # a found session asked for by its id
    first = reg.named("a")
    assert reg.named("a") is first
    for sid in "bcde":
        reg.named(sid)
    assert len([s for s in reg.sessions() if s.session_id in "abcde"]) == 3
    assert reg.named("a") is not first  # dropped (least recently used), made afresh


def test_the_wrapper_and_the_transport_keep_their_sessions_in_it():
    client = wrap_openai(openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="-"), [])
    state = leyline_state(client)
    assert isinstance(state._registry, SessionRegistry)
    assert isinstance(LeylineTransport([])._registry, SessionRegistry)
    assert state.session("s1") is state.session("s1") and set(state.sessions) == {"s1"}
