"""The OpenAI SDK's tool loop on a real trained model whose chat template has no tool block
(SmolLM2-135M-Instruct, ChatML): ``tools`` reach the prompt, calls and results render in the
Hermes form (``directives/tool_prompt.py``), the README's message-form example runs on it,
and under the ``template`` setting such a template refuses ``tools`` with a 400 naming it.

The model comes from ``leyline fetch-model smollm2`` (``smollm2_dir``), loaded once."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from leyline_agent.directives.tool_prompt import set_setting, template_tools
from leyline_agent.errors import RequestError

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                        "b": {"type": "number"}},
                       "required": ["a", "b"]}}},
]  # fmt: skip
RESULTS = {"get_weather": '{"city": "Paris", "sky": "sunny", "celsius": 21}', "add": "7"}


@pytest.fixture(scope="module")
def smol():
    from leyline_agent.engine.checkpoints.fetch import smollm2_dir
    from leyline_agent.engine.engine import Engine
    from leyline_agent.testing.server import serve_in_thread

    engine = Engine.from_pretrained(smollm2_dir())
    with serve_in_thread(engine) as srv:
        yield engine, srv, openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0)


def test_the_template_has_no_tool_block(smol):
    engine, _, _ = smol
    can = template_tools(engine.tokenizer)
    assert not can.tools and not can.calls


def test_the_sdk_runs_a_four_turn_tool_loop(smol):
    """call -> tool result -> call -> answer, each turn the SDK's own objects sent back."""
    engine, _, client = smol
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    bare = client.chat.completions.create(model=engine.model_name, messages=messages,
                                          max_tokens=1, temperature=0)  # fmt: skip
    prompts, names = [], []
    for choice in ("required", "required", "none"):
        r = client.chat.completions.create(
            model=engine.model_name, messages=messages, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, max_tokens=32 if choice == "required" else 8,
            temperature=0,
        )  # fmt: skip
        prompts.append(r.usage)
        message = r.choices[0].message
        messages.append(message)  # content None with the calls: rendered as the calls
        if choice == "none":
            break
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None
        assert len(message.tool_calls) == 1  # parallel_tool_calls false: one call
        for call in message.tool_calls:
            assert call.function.name in RESULTS
            json.loads(call.function.arguments)  # a complete call under the grammar
            names.append(call.function.name)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": RESULTS[call.function.name]})  # fmt: skip
    answer = messages[-1]
    assert answer.content and not answer.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")
    assert len(names) == 2
    # the tools are in the prompt: it is longer than the bare conversation by their block
    assert prompts[0].prompt_tokens > bare.usage.prompt_tokens + 100
    # each turn's prompt holds the last one and its answer: rendered back, the calls and
    # results hit the cache
    for before, after in zip(prompts, prompts[1:], strict=False):
        assert after.prompt_tokens > before.prompt_tokens
        assert after.prompt_tokens_details.cached_tokens >= before.prompt_tokens - 1


def test_the_readme_message_form_example(smol):
    """README.md's message-form example: content null with tool_calls, a tool message."""
    engine, srv, _ = smol
    call = {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    old = [{"role": "user", "content": "List the files."},
           {"role": "assistant", "content": None, "tool_calls": [call]},
           {"role": "tool", "tool_call_id": "call_1",
            "content": "a.py b.py c.py d.py e.py f.py g.py h.py"}]  # fmt: skip
    new = [*old[:2], {**old[2], "content": "[stale output of ls elided]"}]
    chat = {"model": engine.model_name, "messages": old, "max_tokens": 1}
    r = httpx.post(f"{srv.base_url}/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    d = httpx.post(f"{srv.url}/leyline/v1/directives",
                   json={"old_messages": old, "new_messages": new}, timeout=120)  # fmt: skip
    assert d.status_code == 200, d.text
    assert d.json()["outcome"] == "applied" and d.json()["splices"].get("amortize") == 1


def test_the_template_setting_refuses_tools_naming_them(smol):
    engine, srv, client = smol
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    with_call = [{"role": "user", "content": "hi"},
                 {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c1", "content": "7"}]  # fmt: skip
    set_setting(engine.tokenizer, "template")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=engine.model_name, max_tokens=1, tools=TOOLS,
                                           messages=with_call[:1])  # fmt: skip
        assert e.value.body["param"] == "tools" and "template" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=engine.model_name, max_tokens=1,
                                           messages=with_call)  # fmt: skip
        assert e.value.body["param"] == "messages[1]"
    finally:
        set_setting(engine.tokenizer, "hermes")


def test_a_setting_changed_later_reaches_a_thread_that_rendered_before(smol):
    """Each render thread keeps its own copy of the tokenizer (``Engine._render_tokenizer``):
    a thread that rendered under ``hermes`` must see ``template`` once it is set."""
    from concurrent.futures import ThreadPoolExecutor

    engine, _, _ = smol
    user = [{"role": "user", "content": "hi"}]
    with ThreadPoolExecutor(1) as one:
        assert one.submit(engine.render, user, TOOLS, True).result()  # its copy, under hermes
        set_setting(engine.tokenizer, "template")
        try:
            with pytest.raises(RequestError) as e:
                one.submit(engine.render, user, TOOLS, True).result()
            assert e.value.field == "tools"
        finally:
            set_setting(engine.tokenizer, "hermes")


def test_logprobs_and_usage_leave_out_the_stop_token(smol):
    """As OpenAI and vLLM: the answer ends on ``<|im_end|>``, which neither ``logprobs.content``
    lists nor ``completion_tokens`` counts; the listed tokens spell the content."""
    engine, _, client = smol
    r = client.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "What is 2 + 2?"}],
        max_tokens=24, temperature=0, logprobs=True,
    )  # fmt: skip
    c = r.choices[0]
    tokens = [t.token for t in c.logprobs.content]
    assert c.finish_reason == "stop" and "<|im_end|>" not in tokens
    assert r.usage.completion_tokens == len(tokens) and "".join(tokens) == c.message.content
