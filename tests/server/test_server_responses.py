"""``/v1/responses`` over HTTP through the real ``openai`` SDK, on a tiny random-weight model.

Expected prompts are built here independently: the chat messages a Responses request
stands for, rendered with the tokenizer's own chat template. Greedy answers are compared
with the chat route's answer to the same messages (the same engine, another route).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.testing.server import serve_in_thread

ARCH = "llama"
INSTRUCTIONS = "You are a terse assistant."
TOOLS = [
    {
        "type": "function",
        "name": "read_file",
        "description": "read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {k: v for k, v in TOOLS[0].items() if k != "type"},
    }
]


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir(ARCH)


@pytest.fixture(scope="module")
def server(model_dir):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    app = create_app(Engine.from_pretrained(model_dir), client_edits="amortize")
    with serve_in_thread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def rendered(tok, messages, tools=None) -> int:
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return len(out if isinstance(out, list) else out["input_ids"])


def stats(srv):
    return httpx.get(f"{srv.url}/leyline/v1/stats", timeout=60).json()


def test_create_matches_the_chat_route_and_renders_the_instructions(client, name, tok):
    r = client.responses.create(
        model=name, input="Say something.", instructions=INSTRUCTIONS,
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "Say something."},
    ]
    chat = client.chat.completions.create(
        model=name, messages=messages, max_tokens=8, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == rendered(tok, messages)
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    finish = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_assemble_the_unstreamed_response(client, name):
    kwargs = {"model": name, "input": "Count.", "max_output_tokens": 10, "temperature": 0}
    plain = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == f"response.{plain.status}"  # incomplete: cut by max_output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.output_item.added" in types and "response.output_item.done" in types
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert deltas == done.output_text == plain.output_text
    assert [e.text for e in events if e.type == "response.output_text.done"] == [deltas]
    assert done.usage.input_tokens == plain.usage.input_tokens
    assert done.usage.output_tokens == plain.usage.output_tokens
    assert client.responses.retrieve(done.id).output_text == deltas  # stored when complete


def test_previous_response_id_continues_from_the_cache(client, name, tok):
    first = client.responses.create(
        model=name, input="Tell me a story about a lighthouse keeper.",
        instructions=INSTRUCTIONS, max_output_tokens=8, temperature=0,
    )  # fmt: skip
    second = client.responses.create(
        model=name, input="And then?", previous_response_id=first.id,
        instructions=INSTRUCTIONS, max_output_tokens=8, temperature=0,
    )  # fmt: skip
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "Tell me a story about a lighthouse keeper."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == rendered(tok, messages)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 2 > 0  # the first prompt, from the cache


def test_function_call_items_render_as_tool_calls_and_results(client, name, tok):
    items = [
        {"role": "user", "content": "Read a.py"},
        {"type": "function_call", "call_id": "call_x1", "name": "read_file",
         "arguments": '{"path": "a.py"}'},
        {"type": "function_call_output", "call_id": "call_x1", "output": "print('a')"},
    ]  # fmt: skip
    r = client.responses.create(
        model=name, input=items, tools=TOOLS, max_output_tokens=4, temperature=0
    )
    messages = [
        {"role": "user", "content": "Read a.py"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_x1", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_x1", "content": "print('a')"},
    ]  # fmt: skip
    assert r.usage.input_tokens == rendered(tok, messages, CHAT_TOOLS)
    assert r.tools[0].name == "read_file"


def test_an_edited_replay_of_a_chain_is_spliced(server, name, tok):
    """Turns chained by previous_response_id, then the client replays the items itself
    with an earlier tool output stubbed: an in-place edit of the cached conversation."""
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    long_output = " ".join(f"line{j} value={j * 7}" for j in range(60))
    call = {"type": "function_call", "call_id": "call_e1", "name": "read_file",
            "arguments": '{"path": "big.py"}'}  # fmt: skip
    opening = [
        {"role": "user", "content": "Inspect big.py"},
        call,
        {"type": "function_call_output", "call_id": "call_e1", "output": long_output},
    ]
    kw = {"model": name, "tools": TOOLS, "max_output_tokens": 6, "temperature": 0}
    r1 = client.responses.create(input=opening, **kw)
    r2 = client.responses.create(input="Summarise.", previous_response_id=r1.id, **kw)
    stub = {**opening[2], "output": "[elided]"}
    replay = [
        *opening[:2], stub,
        *[i.model_dump(exclude_none=True) for i in r1.output],
        {"role": "user", "content": "Summarise."},
        *[i.model_dump(exclude_none=True) for i in r2.output],
        {"role": "user", "content": "Done?"},
    ]  # fmt: skip
    before = stats(server)
    r3 = client.responses.create(input=replay, **kw)
    after = stats(server)
    assert after["splices"]["amortize"] == before["splices"]["amortize"] + 1
    assert r3.usage.model_extra["leyline"]["splices"]["amortize"] == 1
    messages = [
        {"role": "user", "content": "Inspect big.py"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_e1", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "big.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_e1", "content": "[elided]"},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "Summarise."},
        {"role": "assistant", "content": r2.output_text},
        {"role": "user", "content": "Done?"},
    ]  # fmt: skip
    assert r3.usage.input_tokens == rendered(tok, messages, CHAT_TOOLS)
    # what was cached survived the edit: far more than the prefix before the stub
    head = rendered(tok, messages[:2], CHAT_TOOLS)
    assert r3.usage.input_tokens_details.cached_tokens > head + 10


def test_retrieve_delete_and_unknown_ids(client, name):
    r = client.responses.create(model=name, input="hi", max_output_tokens=2)
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.type == "not_found_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=name, input="x", previous_response_id=r.id)
    assert (e.value.type, e.value.param) == ("invalid_request_error", "previous_response_id")
    unstored = client.responses.create(model=name, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0]"),
        ({"reasoning": {"effort": "bogus"}}, "reasoning.effort"),
        ({"background": True}, "background"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_field(client, name, kwargs, param):
    body = {"model": name, "input": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert (e.value.status_code, e.value.type, e.value.param) == (
        400,
        "invalid_request_error",
        param,
    )


def test_responses_are_per_tenant(model_dir):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    app = create_app(Engine.from_pretrained(model_dir), api_keys=[("ka", "A"), ("kb", "B")])
    with serve_in_thread(app) as srv:
        a = openai.OpenAI(base_url=srv.base_url, api_key="ka", max_retries=0)
        b = openai.OpenAI(base_url=srv.base_url, api_key="kb", max_retries=0)
        name = model_dir.name
        r = a.responses.create(model=name, input="hi", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError):
            b.responses.create(model=name, input="x", previous_response_id=r.id)
        assert a.responses.retrieve(r.id).id == r.id
