"""What the vLLM chat front reads from and adds to an answer (no vLLM needed): the reply
of a JSON answer or of a stream (``front.replies.ReplyReader``), and the fields merged into an
answer or a stream's first event (``http.asgi.annotate``)."""

from __future__ import annotations

import json

from leyline_agent.front.replies import ReplyReader
from leyline_agent.http.asgi import annotate


def _events(*deltas: dict, finish: str | None = "stop") -> bytes:
    out = b""
    for k, d in enumerate(deltas):
        last = k == len(deltas) - 1
        choice = {"index": 0, "delta": d, "finish_reason": finish if last else None}
        out += b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
    return out + b"data: [DONE]\n\n"


def test_a_json_answers_reply_is_its_first_choices_message():
    msg = {"role": "assistant", "content": "hi", "tool_calls": []}
    answer = {"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]}
    r = ReplyReader(stream=False)
    raw = json.dumps(answer).encode()
    r.feed(raw[:7])
    r.feed(raw[7:])  # the body in two chunks
    assert r.reply() == msg
    unfinished = {"choices": [{"index": 0, "message": msg, "finish_reason": None}]}
    r = ReplyReader(stream=False)
    r.feed(json.dumps(unfinished).encode())
    assert r.reply() is None


def test_a_streams_reply_joins_its_deltas_whatever_the_chunking():
    raw = _events(
        {"role": "assistant", "reasoning_content": "let me "},
        {"reasoning_content": "think"},
        {"content": "ok"},
        {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "ls", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
        {"tool_calls": [{"index": 1, "id": "call_2", "function": {"name": "cat"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
        finish="tool_calls",
    )
    want = {
        "role": "assistant",
        "content": "ok",
        "reasoning_content": "let me think",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "ls", "arguments": '{"a":1}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "cat", "arguments": ""}},
        ],
    }
    for size in (1, 5, len(raw)):
        r = ReplyReader(stream=True)
        for i in range(0, len(raw), size):
            r.feed(raw[i : i + size])
        assert r.reply() == want, size


def test_a_stream_cut_short_has_no_reply():
    r = ReplyReader(stream=True)
    r.feed(_events({"content": "par"}, finish=None))
    assert r.reply() is None


def test_annotate_adds_fields_to_an_answer_or_a_streams_first_event():
    extra = {"leyline": {"edits": {"declared": [1], "spliced": [1], "fallback": False}}}
    assert annotate(b'{"id": 1}', extra, False) == b'{"id":1,"leyline":' + (
        b'{"edits":{"declared":[1],"spliced":[1],"fallback":false}}}'
    )
    # objects merge key by key: what the answer has stays
    both = annotate(b'{"usage": {"prompt_tokens": 3}}', {"usage": {"leyline": {"x": 1}}}, False)
    assert both == b'{"usage":{"prompt_tokens":3,"leyline":{"x":1}}}'
    out = annotate(b'data: {"id": 1}\n\ndata: {"id": 2}\n\n', {**extra, "usage": {}}, True)
    first, rest = out.split(b"\n\n", 1)
    assert b'"leyline"' in first and rest == b'data: {"id": 2}\n\n'
    assert b'"usage"' not in first  # a stream carries usage in its last event only
    assert annotate(b"not json", extra, False) == b"not json"
