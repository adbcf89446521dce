"""Conversation lookup never holds the event loop.

A real ``leyline serve`` app (in a thread of this process, so its conversation store can be
filled directly) holds 3,300 anonymous conversations of 400 messages of one key, each equal
to the requests below but for its last message (walked message by message, as the lookup
did before it ruled such a conversation out by that message, that was about 0.8 s of CPU per
lookup here, and on the event loop eight of them stalled ``/health`` 2.1 s). Eight chats of
402 messages arrive at once while ``/health`` is polled and another tenant streams
(``testing.reliability.Watch``): ``/health`` must answer within 0.5 s throughout, and every
chat must be answered. (The bystander's gap is not bounded here: the eight chats' prefills
are real work for the engine; one chat of the shared history runs first, so they are short.)
"""

from __future__ import annotations

import httpx

from leyline_agent.chat_input import canonical_messages
from leyline_agent.front.conversations import CONVERSATION_PREFIX, Conversation
from leyline_agent.server.tenants import key_tenant
from leyline_agent.testing.reliability import ALICE, KEYS, MALLORY, Watch
from leyline_agent.testing.server import serve_in_thread
from leyline_agent.testing.threads import run_together

CONVERSATIONS = 3300
MESSAGES = 400
CHATS = 8
HEALTH_S = 0.5


def test_thousands_of_conversations_cost_the_loop_nothing(model_dir):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    app = create_app(
        Engine.from_pretrained(model_dir), api_keys=list(KEYS.items()), client_edits="amortize"
    )
    store, tenant = app.state.leyline.conversations, KEYS[MALLORY]
    sent = [{"role": "system", "content": "You are terse."}] + [
        {"role": ("user", "assistant")[i % 2], "content": f"message {i}"} for i in range(MESSAGES)
    ]
    ms = canonical_messages(sent)
    for k in range(CONVERSATIONS):  # each differs from the request only in its last message
        raw = [*ms[: MESSAGES - 1], {**ms[MESSAGES - 1], "content": f"other {k}"}]
        store.save(tenant, Conversation(
            id=f"conv-{k}", session=f"{CONVERSATION_PREFIX}{k:032x}", raw=raw, served=raw,
            reply={"role": "assistant", "content": "ok"}, owner=key_tenant(MALLORY),
        ))  # fmt: skip
    name = model_dir.name
    with serve_in_thread(app) as srv:

        def chat(i: int, start) -> int:
            body = {"model": name, "messages": [*sent, {"role": "user", "content": f"q{i}"}],
                    "max_tokens": 1, "temperature": 0}  # fmt: skip
            start.wait()
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=300,
                           headers={"Authorization": f"Bearer {MALLORY}"})  # fmt: skip
            return r.status_code

        with httpx.Client(base_url=srv.url, timeout=300) as c:  # the shared prefix, cached
            warm = {"model": name, "messages": sent, "max_tokens": 1, "temperature": 0}
            c.post("/v1/chat/completions", json=warm,
                   headers={"Authorization": f"Bearer {MALLORY}"}).raise_for_status()  # fmt: skip
        with Watch(srv.url, key=ALICE, model=name) as watch:
            codes = run_together(CHATS, chat)
        report = watch.report()
    assert codes == [200] * CHATS, codes
    assert report.health_polls > 0 and not report.health_errors, report
    assert report.health_worst_s < HEALTH_S, report
