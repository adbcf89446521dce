"""Constrained decoding over HTTP with the real OpenAI client, on a random-weight model.

``tool_choice`` required / named and ``response_format`` json_schema / json_object are
sampled under a grammar (xgrammar, ``engine/grammar.py``). Every answer is checked by an
independent parser: ``json.loads`` and the ``jsonschema`` package's validator against the
schema the client sent. The same requests served without a grammar (the same engine behind
a proxy that says ``supports_grammar = False``) show that the random model does not write a
parseable call by itself: the forced call runs out of tokens with no call (a 200 with
``finish_reason`` ``length``), ``response_format`` is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from leyline_agent.engine.engine import Engine
from leyline_agent.testing.server import serve_in_thread

pytestmark = pytest.mark.slow

ARCH = "llama"
READ = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "maxLength": 12},
        "lines": {"type": "integer", "minimum": 1, "maximum": 500},
    },
    "required": ["path", "lines"],
}
BASH = {
    "type": "object",
    "properties": {"command": {"type": "string", "enum": ["ls", "pwd", "make test"]}},
    "required": ["command"],
}
TOOLS = [
    {"type": "function", "function": {"name": "read", "parameters": READ}},
    {"type": "function", "function": {"name": "bash", "parameters": BASH}},
]
SCHEMAS = {"read": READ, "bash": BASH}
HELLO = [{"role": "user", "content": "look at the repository"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "admin"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


class NoGrammar:
    """The same engine, served as one that cannot constrain its sampling."""

    supports_grammar = False

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def served(engine):
    with serve_in_thread(engine) as srv:
        yield srv, openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def free(engine):
    with serve_in_thread(NoGrammar(engine)) as srv:
        yield srv, openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0)


def _chat(client: openai.OpenAI, name: str, **kw: Any) -> Any:
    kw = {"messages": HELLO, "max_tokens": 160, "temperature": 0, **kw}
    return client.chat.completions.create(model=name, **kw)


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls, "no tool call parsed"
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1])
def test_required_returns_a_call_valid_under_its_schema(served, free, name, seed):
    (_, client), (_, plain) = served, free
    kw = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": seed}
    r = _chat(client, name, **kw)
    _check_calls(r.choices[0].message.tool_calls, {"read", "bash"})
    assert r.choices[0].finish_reason == "tool_calls"
    _no_call(_chat(plain, name, **kw))  # the same request, no grammar


def _no_call(r: Any) -> None:
    """Without the grammar the random model writes no call: the budget runs out (a 200 with
    ``finish_reason`` ``length``, as OpenAI answers it) and nothing it wrote is a call."""
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


def test_a_named_tool_returns_exactly_its_call(served, free, name):
    (_, client), (_, plain) = served, free
    choice = {"type": "function", "function": {"name": "read"}}
    r = _chat(client, name, tools=TOOLS, tool_choice=choice)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1
    _check_calls(calls, {"read"})
    _no_call(_chat(plain, name, tools=TOOLS, tool_choice=choice))


def test_parallel_tool_calls_false_is_one_call(served, name):
    _, client = served
    for seed in range(3):
        r = _chat(
            client, name, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=seed,
        )  # fmt: skip
        assert len(r.choices[0].message.tool_calls) == 1


def test_required_streamed_sends_a_valid_call(served, name):
    _, client = served
    stream = _chat(client, name, tools=TOOLS, tool_choice="required", stream=True)
    chunks = [c for c in stream if c.choices]
    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    calls = [tc for tc in deltas if tc.id]  # each call's head; its arguments in pieces
    for tc in calls:
        tc.function.arguments = "".join(
            d.function.arguments or "" for d in deltas if d.index == tc.index
        )
    _check_calls(calls, {"read", "bash"})
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_json_valid_under_it(served, free, name, stream):
    (_, client), (_, plain) = served, free
    r = _chat(client, name, response_format=FORMAT, stream=stream)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    else:
        text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    free_text = _chat(plain, name, max_tokens=60).choices[0].message.content
    with pytest.raises(ValueError):  # unconstrained, the model does not write JSON
        json.loads(free_text)


def test_json_object_answers_an_object(served, name):
    _, client = served
    for seed in range(2):
        r = _chat(client, name, response_format={"type": "json_object"}, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_responses_api_text_format_and_tool_choice(served, name):
    _, client = served
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON}
    r = client.responses.create(
        model=name, input="who are you", text={"format": fmt}, max_output_tokens=160,
        temperature=0,
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), PERSON)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    for stream in (False, True):
        r = client.responses.create(
            model=name, input="look", tools=tools, tool_choice={"type": "function", "name": "bash"},
            max_output_tokens=160, temperature=0, stream=stream,
        )  # fmt: skip
        if stream:
            r = [e for e in r if e.type == "response.completed"][0].response
        calls = [item for item in r.output if item.type == "function_call"]
        assert [c.name for c in calls] == ["bash"]
        jsonschema.validate(json.loads(calls[0].arguments), BASH)


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "yaml"}, "response_format.type"),
        ("json", "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
            "response_format.json_schema.schema",
        ),
        ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema.name"),
    ],
)  # fmt: skip
def test_bad_response_formats_are_400_naming_the_field(served, name, fmt, param):
    srv, client = served
    before = httpx.get(f"{srv.url}/leyline/v1/stats", timeout=30).json()
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, name, response_format=fmt)
    assert e.value.param == param
    after = httpx.get(f"{srv.url}/leyline/v1/stats", timeout=30).json()
    assert after["prompt_tokens"] == before["prompt_tokens"]  # nothing ran


def test_a_tool_schema_the_compiler_refuses_is_400_naming_tools(served, name):
    _, client = served
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/x"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, name, tools=bad, tool_choice="required")
    assert e.value.param == "tools[0].function.parameters"


def test_responses_api_names_its_own_fields(served, name):
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        fmt = {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nowhere"}}
        client.responses.create(model=name, input="hi", text={"format": fmt})
    assert e.value.param == "text.format.schema"


def test_an_engine_without_a_grammar_refuses_response_format(free, name):
    _, plain = free
    with pytest.raises(openai.BadRequestError) as e:
        _chat(plain, name, response_format={"type": "json_object"})
    assert e.value.param == "response_format"
    r = _chat(plain, name, response_format={"type": "text"}, max_tokens=4)
    assert r.choices[0].message.content is not None
