"""Tool calls streamed as OpenAI's deltas (``tool_calls.ResponseStream``), pure: the deltas add
up to the finished parse, arguments arrive in pieces, and an answer cut by the token budget
never leaves half a call in the content."""

from __future__ import annotations

import json

import pytest

from leyline_agent.server.tool_calls import HERMES, ResponseStream
from leyline_agent.server.tool_choice import ToolChoice


def _run(text: str, *, step: int = 3, truncated: bool = False, forced: str = ""):
    stream = ResponseStream(HERMES)
    if forced:
        stream.prime(forced)
    events = []
    for i in range(0, len(text), step):
        events += stream.push(text[i : i + step])
    more, parsed = stream.finish(truncated)
    events += more
    calls: dict[int, dict] = {}
    pieces: dict[int, int] = {}
    content = ""
    for field, value in events:
        if field == "content":
            content += value
        elif field == "tool_calls":
            k = value["index"]
            if "id" in value:
                assert k not in calls  # the head comes once, first
                calls[k] = {"id": value["id"], "name": value["function"]["name"], "arguments": ""}
            calls[k]["arguments"] += value["function"]["arguments"]
            pieces[k] = pieces.get(k, 0) + 1
    return parsed, content, calls, pieces


def test_arguments_stream_in_pieces_and_add_up_to_the_parse():
    args = {"path": "src/a.py", "patch": "def f():\n    return {1: 2}\n" * 4}
    text = "Let me edit.\n<tool_call>\n" + json.dumps({"name": "edit", "arguments": args})
    text += "\n</tool_call>\n<tool_call>\n" + '{"name": "ls", "arguments": {}}\n</tool_call>'
    parsed, content, calls, pieces = _run(text)
    assert content == parsed.content == "Let me edit."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["edit", "ls"]
    for k, c in enumerate(parsed.tool_calls):
        assert calls[k]["id"] == c["id"]
        assert calls[k]["arguments"] == c["function"]["arguments"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == args
    assert pieces[0] > 10  # many deltas, not one at the close


def test_a_call_the_budget_cut_keeps_what_was_written_and_leaves_no_content():
    forced = ToolChoice("required").forced_prefix()
    parsed, content, calls, _ = _run('{"name": "ls", "arguments": {"path": "sr', truncated=True,
                                     forced=forced)  # fmt: skip
    assert parsed.content is None and content == ""
    assert [c["function"]["arguments"] for c in parsed.tool_calls] == ['{"path": "sr']
    assert calls[0]["arguments"] == '{"path": "sr'


@pytest.mark.parametrize("cut", ['{"na', '{"name": "ls", "argu', ""])
def test_a_block_cut_before_its_name_is_dropped(cut):
    parsed, content, calls, _ = _run("Sure. <tool_call>\n" + cut, truncated=True)
    assert parsed.tool_calls == [] and calls == {}
    assert parsed.content == content == "Sure. "  # the model's text, whitespace included


@pytest.mark.parametrize(
    ("tail", "arguments"),
    [('{"a": "}"}} then', '{"a": "}"}'), ('{"a": 1 then', '{"a": 1 then')],
)
def test_a_block_whose_head_was_written_stays_a_call_however_it_ends(tail, arguments):
    """Its head and arguments were streamed as a call already: it stays one, its arguments
    the complete object, or everything written when the object never closed."""
    parsed, content, calls, _ = _run('<tool_call>\n{"name": "f", "arguments": ' + tail)
    assert [c["function"]["arguments"] for c in parsed.tool_calls] == [arguments]
    assert calls[0]["arguments"] == arguments and content == ""
