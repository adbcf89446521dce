"""OpenAI-compatible routes over real HTTP with the real ``openai`` client.

Ground truth is independent of the server and of the engine: the tokenizer's own chat
template and plain Hugging Face forwards (``leyline_agent.reference.hf_reference``).
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from leyline_agent.reference.hf_reference import hf_greedy
from leyline_agent.testing.server import serve_in_thread
from leyline_agent.testing.token_ids import random_ids

ARCH = "deepseek_v2"
K = 3  # top logprobs




def _template_ids(tok, messages, tools=None) -> list[int]:
    text = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return tok.encode(text, add_special_tokens=False)


def _text(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def test_models_lists_the_model_and_other_names_are_404(client, name):
    assert [m.id for m in client.models.list().data] == [name]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert e.value.body["field"] == "model"


def test_completion_of_token_ids_equals_a_plain_hf_forward(client, name, tok, model_dir, stop_ids):
    ids = random_ids(1, 40)
    g = hf_greedy(model_dir, ids, 6, stop_ids, top_k=K)
    r = client.completions.create(model=name, prompt=ids, max_tokens=6, temperature=0, logprobs=K)
    c = r.choices[0]
    assert r.usage.prompt_tokens == len(ids)  # used as given: no BOS
    assert r.usage.completion_tokens == len(g.token_ids)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert c.text == _text(tok, g.token_ids)
    assert c.finish_reason == ("stop" if g.stopped else "length")
    assert c.logprobs.tokens == [tok.decode([t]) for t in g.token_ids]
    np.testing.assert_allclose(c.logprobs.token_logprobs, g.logprobs, atol=1e-4)
    for have, want in zip(c.logprobs.top_logprobs, g.top, strict=True):
        assert list(have) == list(dict.fromkeys(tok.decode([i]) for i, _ in want))
        np.testing.assert_allclose(
            list(have.values()), [v for _, v in want][: len(have)], atol=1e-4
        )
    again = client.completions.create(
        model=name, prompt=ids, max_tokens=6, temperature=0, logprobs=K
    )
    assert again.usage.prompt_tokens_details.cached_tokens >= len(ids) - 1
    assert again.choices[0].text == c.text
    np.testing.assert_allclose(again.choices[0].logprobs.token_logprobs, g.logprobs, atol=1e-4)


def test_string_prompt_is_tokenized(client, name, tok, model_dir, stop_ids):
    prompt = "def add(a, b):\n    return"
    ids = tok.encode(prompt)
    g = hf_greedy(model_dir, ids, 5, stop_ids)
    r = client.completions.create(model=name, prompt=prompt, max_tokens=5, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == _text(tok, g.token_ids)


MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent."},
    {"role": "user", "content": "Why does test_sum fail? Look at sum_tree.py first."},
]


def test_chat_renders_the_template_and_equals_a_plain_hf_forward(
    client, name, tok, model_dir, stop_ids
):
    ids = _template_ids(tok, MESSAGES)
    g = hf_greedy(model_dir, ids, 6, stop_ids, top_k=K)
    r = client.chat.completions.create(
        model=name,
        messages=MESSAGES,
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=K,
    )
    c = r.choices[0]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(g.token_ids)
    assert c.message.role == "assistant" and c.message.content == _text(tok, g.token_ids)
    assert c.message.tool_calls is None
    assert c.finish_reason == ("stop" if g.stopped else "length")
    got = c.logprobs.content
    assert [x.token for x in got] == [tok.decode([t]) for t in g.token_ids]
    np.testing.assert_allclose([x.logprob for x in got], g.logprobs, atol=1e-4)
    for x, want in zip(got, g.top, strict=True):
        assert [t.token for t in x.top_logprobs] == [tok.decode([i]) for i, _ in want]
        np.testing.assert_allclose(
            [t.logprob for t in x.top_logprobs], [v for _, v in want], atol=1e-4
        )
        assert bytes(x.bytes).decode("utf-8", errors="replace") == x.token


def test_chat_stream_equals_the_answer_and_ends_with_usage(client, name, tok):
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": "Reading it."},
        {"role": "user", "content": "Go on."},
    ]
    kw = dict(model=name, messages=messages, max_tokens=8, temperature=0, logprobs=True)
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [ch for ch in chunks if ch.choices]
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in body)
        == whole.choices[0].message.content
    )
    assert [ch.choices[0].finish_reason for ch in body if ch.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    streamed_lp = [
        x for ch in body if ch.choices[0].logprobs for x in ch.choices[0].logprobs.content
    ]
    assert [x.token for x in streamed_lp] == [x.token for x in whole.choices[0].logprobs.content]
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert (
        last.usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens - 1
    )  # 2nd time


def test_sse_framing_is_exactly_openai(server, name):
    body = {"model": name, "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ")
        assert json.loads(ev[len("data: ") :])["object"] == "chat.completion.chunk"


def test_completion_stream_and_stop_strings(client, name, tok, model_dir, stop_ids):
    ids = random_ids(2, 30)
    g = hf_greedy(model_dir, ids, 10, stop_ids)
    full = _text(tok, g.token_ids)
    assert len(full) >= 4, "the reference continuation is too short to pick a stop string"
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    want = full[: full.index(stop)]
    r = client.completions.create(model=name, prompt=ids, max_tokens=10, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    parts = list(
        client.completions.create(
            model=name, prompt=ids, max_tokens=10, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in parts) == want
    assert parts[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client, name):
    kw = dict(
        model=name, prompt=random_ids(3, 20), max_tokens=6, temperature=1.0, top_p=0.9, seed=1234
    )
    first, second = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert first == second


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "sum_tree.py"}}\n</tool_call>'


class ScriptedEngine:
    """The real engine (template, tokenizer, cache accounting) answering a scripted text.

    A random-weight model never writes a tool call; the server's parsing is what is under
    test, so the model's answer is the one thing replaced.
    """

    def __init__(self, engine, script: str) -> None:
        self._engine, self.script = engine, script

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompt_ids, params, on_token=None, *, namespace=None):
        from leyline_agent.engine.params import GenerationResult

        tok = self._engine.tokenizer
        out = [
            *tok.encode(self.script, add_special_tokens=False),
            tok.convert_tokens_to_ids("<|im_end|>"),
        ]
        for t in out:
            if on_token is not None:
                on_token(t, "")
        return GenerationResult(
            prompt_ids=list(prompt_ids), output_ids=out, text=self.script, finish_reason="stop",
            prompt_tokens=len(prompt_ids), cached_tokens=0, prefilled_tokens=len(prompt_ids),
            logprobs=None, ttft_s=0.0, e2e_s=0.0,
        )  # fmt: skip


@pytest.fixture(scope="module")
def scripted(model_dir):
    from leyline_agent.engine.engine import Engine

    engine = ScriptedEngine(Engine.from_pretrained(model_dir), "Let me look.\n" + CALL)
    with serve_in_thread(engine) as srv:
        yield engine, openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)


def test_tool_calls_are_parsed_from_the_answer(scripted, name, tok):
    engine, client = scripted
    r = client.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS, max_tokens=64)
    c = r.choices[0]
    assert r.usage.prompt_tokens == len(
        _template_ids(tok, MESSAGES, TOOLS)
    )  # tools reached the template
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me look."
    (call,) = c.message.tool_calls
    assert (
        call.type == "function"
        and call.id.startswith("call_")
        and call.function.name == "read_file"
    )
    assert json.loads(call.function.arguments) == {"path": "sum_tree.py"}

    chunks = list(
        client.chat.completions.create(
            model=name, messages=MESSAGES, tools=TOOLS, max_tokens=64, stream=True
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Let me look."
    deltas = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    arguments = "".join(d.function.arguments or "" for d in deltas)  # streamed in pieces
    assert [(d.index, d.id, d.function.name) for d in deltas][0] == (0, deltas[0].id, "read_file")
    assert {d.index for d in deltas} == {0} and json.loads(arguments) == {"path": "sum_tree.py"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    off = client.chat.completions.create(
        model=name, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=64
    )
    assert (
        off.choices[0].message.tool_calls is None
        and off.choices[0].message.content == engine.script
    )
    # tools are rendered with "none" too: the same prompt (and cache) as with "auto"
    assert off.usage.prompt_tokens == len(_template_ids(tok, MESSAGES, TOOLS))


def test_malformed_tool_call_is_left_as_content(scripted, name):
    engine, client = scripted
    engine.script = 'Calling <tool_call>{"name": read_file}</tool_call>'
    try:
        r = client.chat.completions.create(
            model=name, messages=MESSAGES, tools=TOOLS, max_tokens=64
        )
    finally:
        engine.script = "Let me look.\n" + CALL
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == 'Calling <tool_call>{"name": read_file}</tool_call>'
    assert r.choices[0].finish_reason == "stop"


def test_tool_history_from_an_openai_client_renders_like_the_template(client, name, tok):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "def f(): pass"}],
        },
    ]
    r = client.chat.completions.create(
        model=name, messages=history, tools=TOOLS, max_tokens=1, temperature=0
    )
    flat = [*history[:-1], {**history[-1], "content": "def f(): pass"}]
    assert r.usage.prompt_tokens == len(_template_ids(tok, flat, TOOLS))


def test_a_stream_whose_client_leaves_is_stopped_and_frees_the_worker(
    server, client, name, model_dir, stop_ids
):
    ids = random_ids(4, 24)
    assert not hf_greedy(model_dir, ids, 20, stop_ids).stopped, (
        "pick a prompt that does not stop early"
    )
    stats = f"{server.url}/leyline/v1/stats"
    before = httpx.get(stats).json()
    body = {"model": name, "prompt": ids, "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert json.loads(first[len("data: ") :])["choices"][0]["finish_reason"] is None
    # queued behind the abandoned stream: runs once that stream has been stopped
    nxt = client.completions.create(
        model=name, prompt=random_ids(5, 8), max_tokens=1, temperature=0
    )
    after = httpx.get(stats).json()
    assert after["requests"] == before["requests"] + 1  # the abandoned one never completed
    assert after["generated_tokens"] == before["generated_tokens"] + nxt.usage.completion_tokens


def test_developer_role_renders_as_system(client, name, tok):
    dev = [{"role": "developer", "content": MESSAGES[0]["content"]}, MESSAGES[1]]
    r = client.chat.completions.create(model=name, messages=dev, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(_template_ids(tok, MESSAGES))
