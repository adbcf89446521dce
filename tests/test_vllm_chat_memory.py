"""``vllm_plugin.chat_front.ChatMemory`` (no vLLM needed): which remembered list a declared
edit is spliced against, and what a directive run outside the front makes it forget."""

from __future__ import annotations

from array import array

from leyline_agent.vllm_plugin.chat_front import ChatMemory, Sent, annotate


def _m(*texts: str) -> list[dict]:
    return [{"role": "user", "content": t} for t in texts]


def test_the_base_is_the_newest_list_repeated_but_at_the_edits():
    mem = ChatMemory(per_session=2)
    mem.remember("s", Sent(_m("a", "b"), array("i", [1])))
    mem.remember("s", Sent(_m("a", "b", "c"), array("i", [2])))
    new = _m("a", "B", "c", "d")
    assert mem.base_for("s", new, frozenset({1})) == _m("a", "b", "c")
    assert mem.base_for("s", new, frozenset()) is None  # 'B' differs and is not declared
    assert mem.base_for("s", _m("a", "b", "X", "d"), frozenset({3})) is None  # 3 not covered
    assert mem.base_for("other", new, frozenset({1})) is None  # another session's lists
    assert mem.last("s").tokens == array("i", [2])


def test_bounded_and_forgotten_by_a_directive():
    mem = ChatMemory(sessions=2, per_session=1)
    for s in ("a", "b", "c"):
        mem.remember(s, Sent(_m(s), array("i")))
    assert mem.last("a") is None and mem.last("c") is not None  # least recently used went
    mem.forget("c", exact=False)
    assert mem.last("c") is None and not mem.exact("c")
    mem.forget("b", exact=True)
    assert mem.exact("b")


def test_annotate_adds_fields_to_an_answer_or_a_streams_first_event():
    extra = {"leyline": {"edits": {"declared": [1], "spliced": [1], "fallback": False}}}
    assert annotate(b'{"id": 1}', extra, False) == b'{"id":1,"leyline":' + (
        b'{"edits":{"declared":[1],"spliced":[1],"fallback":false}}}'
    )
    # objects merge key by key: what the answer has stays
    both = annotate(b'{"usage": {"prompt_tokens": 3}}', {"usage": {"leyline": {"x": 1}}}, False)
    assert both == b'{"usage":{"prompt_tokens":3,"leyline":{"x":1}}}'
    out = annotate(b'data: {"id": 1}\n\ndata: {"id": 2}\n\n', extra, True)
    first, rest = out.split(b"\n\n", 1)
    assert b'"leyline"' in first and rest == b'data: {"id": 2}\n\n'
    assert annotate(b"not json", extra, False) == b"not json"
