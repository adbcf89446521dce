"""Pure pieces of the server: tool-call parsing, incremental detokenization, error paths."""

from __future__ import annotations

import json

import pytest

from leyline_agent.engine.detokenizer import Detokenizer
from leyline_agent.http_errors import field_path
from leyline_agent.server.streaming import StreamedText, sse
from leyline_agent.server.tool_calls import parse_tool_calls


def _block(name: str, args: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_tool_calls_are_parsed_with_ids_and_json_arguments():
    calls = [("read_file", {"path": "a.py"}), ("run", {"cmd": ["pytest", "-x"], "n": 3})]
    text = "Let me look.\n" + "\n".join(_block(n, a) for n, a in calls)
    out = parse_tool_calls(text)
    assert out.content == "Let me look."
    assert [c["function"]["name"] for c in out.tool_calls] == [n for n, _ in calls]
    assert [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [a for _, a in calls]
    assert all(c["type"] == "function" for c in out.tool_calls)
    ids = [c["id"] for c in out.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)


def test_only_tool_calls_gives_null_content_and_string_arguments_are_kept():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    out = parse_tool_calls(text)
    assert out.content is None
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"x": 1}


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>["f"]</tool_call>',
    ],
)
def test_malformed_tool_calls_stay_in_the_content(bad):
    text = "before " + bad + " after"
    out = parse_tool_calls(text)
    assert out.tool_calls == []
    assert out.content == text


def test_a_malformed_block_next_to_a_good_one_is_kept_verbatim():
    bad = "<tool_call>{oops}</tool_call>"
    text = bad + "\n" + _block("f", {"a": 1})
    out = parse_tool_calls(text)
    assert [c["function"]["name"] for c in out.tool_calls] == ["f"]
    assert out.content == bad


@pytest.fixture(scope="module")
def tokenizer():
    from leyline_agent.engine.checkpoints.toy_tokenizer import train_tokenizer

    return train_tokenizer(vocab_size=400, max_bytes=100_000)


TEXTS = [
    "héllo wörld 日本語 done",
    "x = 1 STOP y = 2",
    "abc ST",  # ends in a prefix of the stop string, never completed
    'ok then\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("tools", [False, True])
def test_streamed_deltas_add_up_to_the_final_text(tokenizer, text, tools):
    """The engine's detokenizer, then the chat route's ``StreamedText``: deltas never show a
    stop string, a partial character or a tool tag, and sum to the answer."""
    stop = ["STOP"]
    ids = tokenizer.encode(text)

    def decode(xs):
        return tokenizer.decode(xs, skip_special_tokens=True)

    detok = Detokenizer(tokenizer, stop)
    streamed_text = StreamedText(tool_tag="<tool_call>" if tools else None)
    deltas = []
    for k, t in enumerate(ids):
        delta = detok.push(t)
        if detok.stopped or k == len(ids) - 1:
            delta += detok.flush()
        deltas.append(streamed_text.push(delta))
        if detok.stopped:
            break
    full = decode(ids)
    final = full[: full.index("STOP")] if "STOP" in full else full  # what the engine returns
    assert detok.text == final
    if tools:
        parsed = parse_tool_calls(final)
        final = parsed.content if parsed.tool_calls else final
    streamed = "".join(deltas)
    assert final.startswith(streamed)
    assert "\ufffd" not in streamed and "STOP" not in streamed
    if tools:
        assert "<tool_call>" not in streamed
    assert streamed + streamed_text.finish(final) == final


def test_the_detokenizer_decodes_a_window_not_the_whole_output(tokenizer):
    """Each token costs one decode of the tokens since the text was last complete, and the
    text equals a decode of everything (multi-byte characters split over byte tokens)."""
    ids = tokenizer.encode("héllo wörld 日本語 done " * 20)
    seen: list[int] = []

    class Counting:
        def decode(self, xs, **kw):
            seen.append(len(xs))
            return tokenizer.decode(xs, **kw)

    detok = Detokenizer(Counting())
    text = "".join(detok.push(t) for t in ids) + detok.flush()
    assert text == detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(seen) <= 8 < len(ids)


def test_sse_framing_is_openai_style():
    assert sse({"a": [1, "é"]}) == 'data: {"a":[1,"é"]}\n\n'


def test_field_paths_name_the_field_like_the_request_writes_it():
    assert field_path(("body", "messages", 2, "role")) == "messages[2].role"
    assert field_path(("body", "directives", 0, "end")) == "directives[0].end"
    assert field_path(("body", 17)) == "body[17]"


def _params(body: dict, prompt_len: int = 10, context: int | None = 100, default: int = 50):
    from leyline_agent.server.completions import ModelLimits, ServedModel, sampling_params
    from leyline_agent.server.openai_api import ChatCompletionRequest, CompletionRequest

    model = ServedModel("m", frozenset(), 0, ModelLimits(1000, context), default_max_tokens=default)
    cls = ChatCompletionRequest if "messages" in body else CompletionRequest
    return sampling_params(cls.model_validate({"model": "m", **body}), prompt_len, model)


CHAT = {"messages": [{"role": "user", "content": "x"}]}


def test_max_tokens_defaults_and_limits():
    from leyline_agent.server.errors import RequestError

    assert _params(CHAT).max_tokens == 50  # the server's chat default
    assert _params(CHAT, prompt_len=80).max_tokens == 20  # ... within the context
    assert _params(CHAT, context=None, default=7).max_tokens == 7
    assert _params({"prompt": "x"}).max_tokens == 16  # legacy completions default
    assert _params({**CHAT, "max_tokens": 5, "max_completion_tokens": 9}).max_tokens == 9
    with pytest.raises(RequestError) as e:
        _params({**CHAT, "max_completion_tokens": 95})
    assert e.value.field == "max_completion_tokens"
    with pytest.raises(RequestError) as e:
        _params(CHAT, prompt_len=100)
    assert e.value.field == "messages"


def test_sampling_fields_reach_the_engine_params():
    p = _params(
        {
            **CHAT,
            "temperature": 0.5,
            "top_p": 0.8,
            "seed": 3,
            "stop": "END",
            "logprobs": True,
            "top_logprobs": 4,
        }
    )
    assert (p.temperature, p.top_p, p.seed, p.stop, p.logprobs, p.top_logprobs) == (
        0.5,
        0.8,
        3,
        ["END"],
        True,
        4,
    )
    assert _params(CHAT).temperature == 1.0  # OpenAI's default
    q = _params({"prompt": [1, 2], "logprobs": 0})
    assert (q.logprobs, q.top_logprobs) == (True, 0)


def test_logprobs_formats_and_minus_infinity():
    from leyline_agent.engine.params import TokenLogprob
    from leyline_agent.server import logprobs

    entries = [
        TokenLogprob(5, "ab", -0.25, [(5, "ab", -0.25), (9, "c", -1.5)]),
        TokenLogprob(7, "é", float("-inf"), [(3, "x", -0.1), (7, "é", float("-inf"))]),
    ]
    chat = logprobs.chat(entries)["content"]
    assert [(c["token"], c["logprob"], c["bytes"]) for c in chat] == [
        ("ab", -0.25, [97, 98]),
        ("é", -9999.0, [195, 169]),
    ]
    assert [t["token"] for t in chat[0]["top_logprobs"]] == ["ab", "c"]
    legacy = logprobs.legacy(entries, 2)
    assert legacy["tokens"] == ["ab", "é"] and legacy["text_offset"] == [0, 2]
    assert legacy["token_logprobs"] == [-0.25, -9999.0]
    assert legacy["top_logprobs"] == [{"ab": -0.25, "c": -1.5}, {"x": -0.1, "é": -9999.0}]
    json.dumps(legacy, allow_nan=False)  # JSON-safe
    assert logprobs.legacy(entries, 0)["top_logprobs"] is None
