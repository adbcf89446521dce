"""``tool_choice`` over HTTP with the real OpenAI client: required, a named function, none.

The tiny model has random weights and never writes a well-formed call, so the paths where a
model complies are served by ``ComplyingModel``: the real engine's tokenizer, chat template,
cache and stats, with the sampled continuation replaced by a scripted one (a capable model
is the one thing that cannot run here). The prompt the model is given is checked against
the tokenizer's own ``apply_chat_template``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine
from leyline_agent.engine.params import GenerationResult
from leyline_agent.testing.server import serve_in_thread

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {arg: {"type": "string"}}}}}
    for name, arg in (("bash", "command"), ("read", "path"))
]  # fmt: skip
HELLO = [{"role": "user", "content": "list the files"}]


class ComplyingModel:
    """A served engine that answers with ``script.pop(0)`` after whatever prompt it gets."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.script, self.prompts = engine, [], []
        self.model_name = engine.model_name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def render(self, *a: Any, **k: Any) -> list[int]:
        return self.engine.render(*a, **k)

    def apply_directives(self, *a: Any, **k: Any) -> Any:
        return self.engine.apply_directives(*a, **k)

    def stats(self, *a: Any, **k: Any) -> Any:
        return self.engine.stats(*a, **k)

    def generate(self, prompt_ids, params, on_token=None, *, namespace=None) -> GenerationResult:
        self.prompts.append(list(prompt_ids))
        text = self.script.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        for k, t in enumerate(ids):
            if on_token is not None:
                on_token(t, self.tokenizer.decode(ids[: k + 1]) if k == 0 else "")
        t0 = time.perf_counter()
        return GenerationResult(
            prompt_ids=list(prompt_ids), output_ids=ids, text=text, finish_reason="stop",
            prompt_tokens=len(prompt_ids), cached_tokens=0, prefilled_tokens=len(prompt_ids),
            logprobs=None, ttft_s=0.0, e2e_s=time.perf_counter() - t0,
        )  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(tiny_model_dir("deepseek_v2"))


@pytest.fixture(scope="module")
def complying(engine):
    model = ComplyingModel(engine)
    with serve_in_thread(model) as srv:
        yield model, openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0)


def _expected_prompt(tok, forced: str) -> list[int]:
    text = tok.apply_chat_template(HELLO, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False) + tok.encode(forced, add_special_tokens=False)


def test_required_forces_a_call_and_returns_it(complying, engine):
    model, client = complying
    model.script = ['{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>']
    r = client.chat.completions.create(
        model=model.model_name, messages=HELLO, tools=TOOLS, tool_choice="required", max_tokens=40
    )
    assert model.prompts[-1] == _expected_prompt(engine.tokenizer, "<tool_call>\n")
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("bash", {"command": "ls"})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None


def test_a_named_function_forces_its_name(complying, engine):
    model, client = complying
    model.script = ['{"path": "a.py"}}\n</tool_call>']
    choice = {"type": "function", "function": {"name": "read"}}
    r = client.chat.completions.create(
        model=model.model_name, messages=HELLO, tools=TOOLS, tool_choice=choice, max_tokens=40
    )
    forced = '<tool_call>\n{"name": "read", "arguments": '
    assert model.prompts[-1] == _expected_prompt(engine.tokenizer, forced)
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("read", {"path": "a.py"})


def test_required_streamed_sends_the_call_and_no_content(complying):
    model, client = complying
    model.script = ['{"name": "read", "arguments": {"path": "b"}}\n</tool_call>']
    chunks = list(
        client.chat.completions.create(
            model=model.model_name, messages=HELLO, tools=TOOLS, tool_choice="required",
            max_tokens=40, stream=True,
        )
    )  # fmt: skip
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert content == "" and [c.function.name for c in calls if c.id] == ["read"]
    assert {c.index for c in calls} == {0}  # the head once, then the arguments' deltas
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"path": "b"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_that_does_not_comply_is_a_clear_error(complying, stream):
    model, client = complying
    model.script = ["I would rather not."]
    with pytest.raises(openai.APIError) as e:
        out = client.chat.completions.create(
            model=model.model_name, messages=HELLO, tools=TOOLS, tool_choice="required",
            max_tokens=40, stream=stream,
        )  # fmt: skip
        list(out) if stream else None
    assert "tool_choice" in e.value.message and "rather not" in e.value.message
    if not stream:
        assert isinstance(e.value, openai.UnprocessableEntityError)
        assert (e.value.param, e.value.code) == ("tool_choice", "tool_choice_not_met")


def test_none_renders_the_tools_and_parses_no_call(complying, engine):
    model, client = complying
    model.script = ['<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call>']
    r = client.chat.completions.create(
        model=model.model_name, messages=HELLO, tools=TOOLS, tool_choice="none", max_tokens=40
    )
    assert model.prompts[-1] == _expected_prompt(engine.tokenizer, "")  # same prompt as auto
    assert r.choices[0].message.tool_calls is None and "bash" in r.choices[0].message.content


@pytest.mark.parametrize(
    ("choice", "param"),
    [
        ({"type": "function", "function": {"name": "write"}}, "tool_choice.function.name"),
        ("always", "tool_choice"),
        ({"type": "function"}, "tool_choice"),
    ],
)
def test_bad_tool_choices_are_400_naming_the_field(complying, choice, param):
    model, client = complying
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model.model_name, messages=HELLO, tools=TOOLS, tool_choice=choice
        )
    assert e.value.param == param


def test_the_real_model_gets_the_forced_prompt(engine):
    with serve_in_thread(Engine.from_pretrained(tiny_model_dir("deepseek_v2"))) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0)
        try:
            r = client.chat.completions.create(
                model=engine.model_name, messages=HELLO, tools=TOOLS, tool_choice="required",
                max_tokens=24, temperature=0,
            )  # fmt: skip
            assert r.choices[0].message.tool_calls  # a random model rarely gets here
        except openai.UnprocessableEntityError as e:
            assert e.param == "tool_choice"
        stats = httpx.get(f"{srv.url}/leyline/v1/stats", timeout=30).json()
    assert stats["prompt_tokens"] == len(_expected_prompt(engine.tokenizer, "<tool_call>\n"))
