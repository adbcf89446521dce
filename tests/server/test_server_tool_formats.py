"""Tool-call and reasoning parsing per model family (transformers' response parser run on
``families.TOOL_FORMATS``), on hand-written model outputs, whole and streamed character by
character; the format picked from a chat template; and one conversation over HTTP through
the OpenAI SDK on a reasoning family of ``leyline make-model`` (qwen3), streamed and not.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine
from leyline_agent.engine.params import GenerationResult
from leyline_agent.families import TOOL_FORMATS, tool_format
from leyline_agent.server.tool_calls import ResponseStream, parse_response, split_reasoning
from leyline_agent.testing.server import serve_in_thread

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}}}}},
]  # fmt: skip
DSB, DSE = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
# (format, reasoning, model output, content, [(name, arguments)], reasoning_content)
CASES = [
    ("hermes", False, 'ok\n<tool_call>\n{"name": "read", "arguments": {"path": "a"}}\n</tool_call>',
     "ok", [("read", {"path": "a"})], None),
    ("hermes", True, '<think>\nlook first\n</think>\n\nSure.<tool_call>{"name": "read", "arguments": {}}</tool_call>',
     "Sure.", [("read", {})], "look first"),
    ("hermes", True, "<think>hm</think>\n\nJust text.", "Just text.", [], "hm"),
    ("llama3_json", False, '{"name": "read", "parameters": {"path": "b", "lines": 3}}',
     None, [("read", {"path": "b", "lines": 3})], None),
    ("llama3_json", False, '<|python_tag|>{"name": "read", "parameters": {}}; {"name": "read", "parameters": {"path": "c"}}',
     None, [("read", {}), ("read", {"path": "c"})], None),
    ("llama3_json", False, "No call {here}.", "No call {here}.", [], None),
    ("qwen3_xml", True, "<think>plan</think>\nLet me read.\n<tool_call>\n<function=read>\n<parameter=path>\na.py\n</parameter>\n<parameter=lines>\n10\n</parameter>\n</function>\n</tool_call>",
     "Let me read.", [("read", {"path": "a.py", "lines": 10})], "plan"),
    ("deepseek_v3", False, f'Checking.{DSB}function<｜tool▁sep｜>read\n```json\n{{"path": "d"}}\n```{DSE}',
     "Checking.", [("read", {"path": "d"})], None),
    ("deepseek_v3", True, f'<think>x</think>{DSB}function<｜tool▁sep｜>read\n```json\n{{}}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>read\n```json\n{{"lines": 2}}\n```{DSE}',
     None, [("read", {}), ("read", {"lines": 2})], "x"),
]  # fmt: skip


def _calls(parsed: Any) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


@pytest.mark.parametrize(("fmt", "reasoning", "text", "content", "calls", "thinking"), CASES)
def test_each_format_whole_and_streamed(fmt, reasoning, text, content, calls, thinking):
    whole = parse_response(text, TOOL_FORMATS[fmt], reasoning=reasoning, tools=TOOLS)
    assert (whole.content, _calls(whole), whole.reasoning_content) == (content, calls, thinking)
    stream = ResponseStream(TOOL_FORMATS[fmt], reasoning=reasoning, tools=TOOLS)
    deltas = [d for ch in text for d in stream.push(ch)]
    rest, parsed = stream.finish()
    deltas += rest
    assert (parsed.content, _calls(parsed), parsed.reasoning_content) == (content, calls, thinking)
    sent = {f: "".join(t for g, t in deltas if g == f) for f in ("content", "reasoning_content")}
    assert sent == {"content": content or "", "reasoning_content": thinking or ""}


def test_a_malformed_block_stays_in_the_content_verbatim():
    text = "a <tool_call>{oops}</tool_call> b"
    assert parse_response(text).content == text
    assert parse_response(text).tool_calls == []


def test_the_prompt_can_open_the_thinking():
    prefix = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert split_reasoning("plan it\n</think>\n\nanswer", prefix) == ("plan it", "answer")
    assert split_reasoning("no thinking here") == (None, "no thinking here")


@pytest.mark.parametrize(
    ("model_type", "template", "expected"),
    [
        ("llama", "{{ '<|start_header_id|>' }} ... <tool_call>", "llama3_json"),
        ("llama", "<|im_start|>{{ m }} <tool_call>", "hermes"),  # make-model's tokenizer
        ("qwen3", "<tool_call>\n<function={{ name }}>", "qwen3_xml"),
        ("qwen3", "<tool_call>{{ call | tojson }}</tool_call>", "hermes"),
        ("deepseek_v3", "{{ '<｜tool▁calls▁begin｜>' }}", "deepseek_v3"),
        ("mistral", "<|start_header_id|>", "hermes"),  # no other format listed for it
        (None, None, "hermes"),
    ],
)
def test_the_format_is_chosen_by_the_family_and_its_template(model_type, template, expected):
    assert tool_format(model_type, template).name == expected


def test_make_model_checkpoints_speak_hermes():
    from transformers import AutoTokenizer

    for arch in ("llama", "qwen3", "deepseek_v3"):
        tok = AutoTokenizer.from_pretrained(tiny_model_dir(arch))
        assert tool_format(arch, tok.chat_template).name == "hermes"


class Scripted:
    """A served qwen3 engine whose answer is ``script.pop(0)`` (a capable model's output)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.script = engine, []
        self.model_name, self.config = engine.model_name, engine.config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, prompt_ids, params, on_token=None, *, namespace=None) -> GenerationResult:
        text = self.script.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        sent = ""
        for k, t in enumerate(ids):
            delta = self.tokenizer.decode(ids[: k + 1])[len(sent) :]
            sent += delta
            if on_token is not None:
                on_token(t, delta)
        return GenerationResult(
            prompt_ids=list(prompt_ids), output_ids=ids, text=text, finish_reason="stop",
            prompt_tokens=len(prompt_ids), cached_tokens=0, prefilled_tokens=len(prompt_ids),
            logprobs=None, ttft_s=0.0, e2e_s=0.0,
        )  # fmt: skip


ANSWER = '<think>\nI should read it.\n</think>\n\nReading.\n<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_and_calls_over_http(stream):
    model = Scripted(Engine.from_pretrained(tiny_model_dir("qwen3")))
    with serve_in_thread(model) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0)
        model.script = [ANSWER]
        kw = {"model": model.model_name, "messages": [{"role": "user", "content": "go"}]}
        r = client.chat.completions.create(**kw, tools=TOOLS, max_tokens=64, stream=stream)
        if stream:
            chunks = [c for c in r if c.choices]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            thinking = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
            deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
            calls = [tc for tc in deltas if tc.id]  # the head of each; arguments in pieces
            for tc in calls:
                tc.function.arguments = "".join(
                    d.function.arguments or "" for d in deltas if d.index == tc.index
                )
            finish = chunks[-1].choices[0].finish_reason
        else:
            msg = r.choices[0].message
            content, thinking, calls = msg.content, msg.reasoning_content, msg.tool_calls
            finish = r.choices[0].finish_reason
    assert (content, thinking, finish) == ("Reading.", "I should read it.", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("read", {"path": "a.py"})]
