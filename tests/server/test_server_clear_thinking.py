"""``context_management`` ``clear_thinking_20251015`` beside ``clear_tool_uses`` over HTTP.

A real ``leyline serve`` app (tiny random-weight model) driven by the ``openai`` SDK. The
expected prompt is built here: the messages with the earlier ``<think>`` spans removed by
hand, rendered with the tokenizer's own chat template.
"""

from __future__ import annotations

import openai
import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.testing.server import serve_in_thread

ARCH = "llama"
BOTH = {
    "edits": [
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1}},
    ]
}
THINK_A = "<think>First I will weigh options one, two and three carefully.</think>\n"
THINK_B = "<think>Now option two looks best.</think>\n"


def history(think_a: str = THINK_A, think_b: str = THINK_B) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You think before you answer."},
        {"role": "user", "content": "Pick an option."},
        {"role": "assistant", "content": f"{think_a}Option one."},
        {"role": "user", "content": "Are you sure?"},
        {"role": "assistant", "content": f"{think_b}Option two."},
        {"role": "user", "content": "Why?"},
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


def rendered(tok, messages) -> int:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(out if isinstance(out, list) else out["input_ids"])


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def test_clear_thinking_beside_clear_tool_uses_is_accepted_and_clears(client, name, tok):
    r = client.chat.completions.create(
        model=name, messages=history(), max_tokens=4, temperature=0,
        extra_body={"context_management": BOTH},
    )  # fmt: skip
    thinking, tools = r.model_extra["context_management"]["applied_edits"]
    saved = n_tokens(tok, f"{THINK_A}Option one.") - n_tokens(tok, "Option one.")
    assert thinking == {
        "type": "clear_thinking_20251015",
        "cleared_thinking_turns": 1,
        "cleared_input_tokens": saved,
    }
    assert tools["type"] == "clear_tool_uses_20250919" and tools["cleared_tool_uses"] == 0
    assert r.usage.prompt_tokens == rendered(tok, history(think_a=""))


def test_nothing_to_clear_is_reported_as_zero(client, name, tok):
    plain = history(think_a="", think_b="")
    r = client.chat.completions.create(
        model=name, messages=plain, max_tokens=2, extra_body={"context_management": BOTH}
    )
    thinking = r.model_extra["context_management"]["applied_edits"][0]
    assert thinking["cleared_thinking_turns"] == 0 and thinking["cleared_input_tokens"] == 0
    assert r.usage.prompt_tokens == rendered(tok, plain)


def test_clearing_cached_thinking_is_a_splice(server, name, tok):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    first = client.chat.completions.create(
        model=name, messages=history(), max_tokens=4, temperature=0
    )  # served as sent: both thinking spans cached
    reply = first.choices[0].message.content
    turn = [*history(), {"role": "assistant", "content": reply}, {"role": "user", "content": "Ok."}]
    second = client.chat.completions.create(
        model=name, messages=turn, max_tokens=4, temperature=0,
        extra_body={"context_management": BOTH},
    )  # fmt: skip
    directives = second.model_extra["leyline"]["directives"]
    assert [d["kind"] for d in directives] == ["context_management"]
    assert directives[0]["splices"]["amortize"] == 1
    expected = [*history(think_a=""), *turn[len(history()) :]]
    assert second.usage.prompt_tokens == rendered(tok, expected)
    # the rows after the cleared span came from the cache, not from a prefill
    head = rendered(tok, history()[:2])
    assert second.usage.prompt_tokens_details.cached_tokens > head + 10


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": -1}},
         "context_management.edits[0].keep.value"),
        ({"type": "clear_thinking_20251015", "keep": "some"}, "context_management.edits[0].keep"),
        ({"type": "clear_thinking_20251015", "trigger": 1}, "context_management.edits[0].trigger"),
    ],
)  # fmt: skip
def test_a_bad_clear_thinking_edit_is_a_400_naming_the_field(client, name, edit, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=name, messages=history(), max_tokens=1,
            extra_body={"context_management": {"edits": [edit]}},
        )  # fmt: skip
    assert e.value.type == "invalid_request_error"
    assert (e.value.param or "").startswith(field), e.value.param
