"""Hostile schemas over HTTP, on a live ``leyline serve`` watched by the harness (conftest):
the schema work runs off the event loop within bounds, so each is refused (or answered)
within 10 s while another tenant streams and ``/health`` answers.

- 120 tools whose parameters nest an array 100 deep: a 400 naming the first over-deep schema;
- ``response_format`` with 2,000 optional properties: a 400 naming the schema's properties;
- 121 tools (the server runs with ``--max-tools 120``), and schemas over the byte limit:
  400s naming ``tools`` / the schema passing it;
- a prompt over the length limit beside those tools: refused for its length (``messages``),
  before any schema work;
- strictness: a remote or ``file:`` ``$ref`` is a 400 naming it; a tool schema the grammar
  compiler refuses is a 400 under ``tool_choice`` ``auto`` and ``none`` as under ``required``.
- The compile deadline itself (the engine's grammar compiler, no server): a schema whose
  compile passes it is refused naming its field.
"""

from __future__ import annotations

import pytest

from leyline_agent.testing.reliability import function_tool as _tool
from leyline_agent.testing.reliability import nested_array as _nested

CHAT = "/v1/chat/completions"
SERVER_ARGS = ("--max-tools", "120")
SCHEMA = "response_format.json_schema.schema"


def _object(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


def _chat(name: str, **extra) -> dict:
    body = {"model": name, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    return {**body, "temperature": 0, **extra}


def test_120_tools_of_100_level_arrays(hostile, post, served_name):
    tools = [_tool(f"t{k}", _object(a=_nested(100))) for k in range(120)]
    hostile(lambda: post(CHAT, _chat(served_name, tools=tools)), field="tools[")


def test_2000_optional_properties(hostile, post, served_name):
    schema = {"type": "object", "properties": {f"p{k}": {"type": "integer"} for k in range(2000)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "many", "schema": schema}}
    answer = hostile(lambda: post(CHAT, _chat(served_name, response_format=fmt)), field=SCHEMA)
    assert answer.error_field == f"{SCHEMA}.properties"


def test_too_many_tools_and_too_many_bytes(hostile, post, served_name):
    tools = [_tool(f"t{k}", _object(a={"type": "string"})) for k in range(121)]
    hostile(lambda: post(CHAT, _chat(served_name, tools=tools)), field="tools")
    wide = _object(**{f"p{k}_{'x' * 200}": {"type": "string"} for k in range(400)})  # 170 KB
    tools = [_tool(f"t{k}", wide) for k in range(3)]
    answer = hostile(lambda: post(CHAT, _chat(served_name, tools=tools)), field="tools[1]")
    assert "bytes" in answer.response.json()["error"]["message"]


def test_a_long_prompt_is_refused_before_the_schemas(hostile, post, served_name):
    tools = [_tool(f"t{k}", _object(a=_nested(100))) for k in range(120)]
    long = [{"role": "user", "content": "word " * 600_000}]
    body = _chat(served_name, tools=tools, messages=long)
    hostile(lambda: post(CHAT, body), field="messages")


@pytest.mark.parametrize(
    "ref", ["https://example.com/s.json", "file:///etc/passwd", "other.json#/a"]
)
def test_a_remote_ref_is_refused_naming_it(hostile, post, served_name, ref):
    tools = [_tool("t", _object(a={"$ref": ref}))]
    field = "tools[0].function.parameters.properties.a.$ref"
    hostile(lambda: post(CHAT, _chat(served_name, tools=tools, tool_choice="auto")), field=field)
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": _object(a={"$ref": ref})}}
    answer = hostile(lambda: post(CHAT, _chat(served_name, response_format=fmt)), field=SCHEMA)
    assert answer.error_field == f"{SCHEMA}.properties.a.$ref"


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required"])
def test_a_refused_tool_schema_under_every_tool_choice(hostile, post, served_name, tool_choice):
    tools = [_tool("ok", _object(a={"type": "string"})), _tool("bad", _object(a={"type": "strin"}))]
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    body = _chat(served_name, tools=tools, **extra)
    hostile(lambda: post(CHAT, body), field="tools[1].function.parameters")


def test_a_compile_past_its_deadline_is_refused(tok):
    from leyline_agent.engine import grammar_spec as gs
    from leyline_agent.engine.grammar import Grammars
    from leyline_agent.errors import InvalidRequestError

    grammars = Grammars(tok, len(tok), [0], compile_deadline_s=0.05)
    schema = {"type": "object", "properties": {f"q{k}": {"type": "integer"} for k in range(200)}}
    with pytest.raises(InvalidRequestError, match="did not compile within") as e:
        grammars.compile(gs.json_schema(schema, "the.field"))
    assert e.value.field == "the.field"
