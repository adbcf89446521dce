"""Which requests continue a conversation with messages edited in place (``ConversationStore``).

A user message (no call id of its own) is believed edited only when the echo carries the
reply's random call ids: in ``tool_calls``, or quoted in the assistant text (smolagents).
A text-only echo proves nothing about who edited a user message.
"""

from __future__ import annotations

import sys

from leyline_agent.front.conversations import ConversationStore

CALL = "call_0123456789abcdef01234567"
REPLY_CALLS = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": CALL, "type": "function", "function": {"name": "read", "arguments": "{}"}}
    ],
}
REPLY_TEXT = {"role": "assistant", "content": "I will read it."}


def _store(reply: dict) -> tuple[ConversationStore, list[dict]]:
    store = ConversationStore()
    conv = store.new("", None)
    conv.raw = [
        {"role": "user", "content": "task"},
        {"role": "user", "content": "Observation: a long file"},
    ]
    conv.served, conv.reply = list(conv.raw), reply
    store.save("", conv)
    return store, conv.raw


def _edited(raw: list[dict]) -> list[dict]:
    return [raw[0], {"role": "user", "content": "Observation: [cleared]"}]


def test_a_user_message_edit_is_believed_from_call_ids_echoed_in_tool_calls_or_text():
    for echo in (
        REPLY_CALLS,
        {"role": "assistant", "content": f"Calling tools:\n[{{'id': '{CALL}', 'name': 'read'}}]"},
    ):
        store, raw = _store(REPLY_CALLS)
        m = store.find("", None, [*_edited(raw), echo, {"role": "user", "content": "next"}])
        assert m is not None and m.edited == (1,), echo


def test_a_user_message_edit_is_not_believed_without_the_call_ids():
    store, raw = _store(REPLY_CALLS)
    wrong = {"role": "assistant", "content": "Calling tools:\n[{'id': 'call_other'}]"}
    assert store.find("", None, [*_edited(raw), wrong]) is None
    # a reply without calls: its text echo continues the conversation, but not a user edit
    store, raw = _store(REPLY_TEXT)
    assert store.find("", None, [*raw, REPLY_TEXT]) is not None
    assert store.find("", None, [*_edited(raw), REPLY_TEXT]) is None


def test_a_tenants_conversations_are_bounded_by_the_memory_they_hold_lru_first():
    def held(raw: list, reply: dict, tokens: int) -> int:  # one list for sent and served
        strings = [*raw[0].keys(), *raw[0].values(), *reply.values()]  # keys shared
        dicts = sys.getsizeof(raw[0]) + sys.getsizeof(reply)
        return sys.getsizeof(raw) + dicts + sum(map(sys.getsizeof, strings)) + 40 * tokens

    reply = {"role": "assistant", "content": "r" * 10}
    sizes = [held([{"role": "user", "content": f"{k}" * 1000}], reply, 100) for k in range(10)]
    budget = sum(sizes[-4:]) + sizes[0] // 2  # 4 fit, a fifth would not
    store = ConversationStore(per_tenant_bytes=budget)
    ids = []
    for k in range(10):  # 1,000 characters sent and served (one list) + a reply, 100 token ids
        conv = store.new("t", None)
        conv.raw = conv.served = [{"role": "user", "content": f"{k}" * 1000}]
        conv.reply, conv.tokens = reply, tuple(range(1000, 1100))
        store.save("t", conv)
        ids.append(conv.id)
    kept = [cid for cid in ids if cid in store._tenants["t"]]
    assert kept == ids[-4:]
    other = store.new("u", None)
    other.raw = other.served = [{"role": "user", "content": "x" * 500_000}]
    store.save("u", other)  # over the budget alone: the one just saved is kept
    assert len(store) == 5
    assert store.forget_tenant("t") == 4 and len(store) == 1
