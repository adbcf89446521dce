"""The Responses API's smaller routes on a real ``leyline serve``, through the ``openai`` SDK:
``input_items``, ``input_tokens``, ``cancel`` and ``compact`` (served, or refused by name).

The server, client and tokenizer are conftest's (``ARCH``'s tiny model). Expected token
counts are the tokenizer's own chat template over the chat messages the items stand for.
"""

from __future__ import annotations

import httpx
import openai
import pytest

ARCH = "llama"


def rendered(tok, messages) -> int:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(out if isinstance(out, list) else out["input_ids"])


def test_input_items_list_the_conversation(client, name):
    first = client.responses.create(model=name, input="Name a colour.", max_output_tokens=3)
    second = client.responses.create(
        model=name, input="And another.", previous_response_id=first.id, max_output_tokens=3
    )
    items = client.responses.input_items.list(second.id, order="asc")
    texts = [(i.type, getattr(i, "role", None)) for i in items.data]
    assert texts == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items.data[0].content[0].text == "Name a colour."
    assert items.data[2].content[0].text == "And another."
    page = client.responses.input_items.list(
        second.id, order="asc", limit=1, after=items.data[0].id
    )
    assert [i.id for i in page.data] == [items.data[1].id] and page.has_more
    newest = client.responses.input_items.list(second.id, limit=1)
    assert newest.data[0].id == items.data[2].id  # desc by default
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_input_tokens_count_the_prompt(client, name, tok):
    r = client.responses.input_tokens.count(
        model=name, input="Name a colour.", instructions="Be brief."
    )
    assert r.input_tokens == rendered(
        tok,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    )
    answer = client.responses.create(model=name, input="Name a colour.", instructions="Be brief.",
                                     max_output_tokens=2)  # fmt: skip
    assert answer.usage.input_tokens == r.input_tokens


def test_cancel_and_compact_are_refused_by_name(client, server, name):
    stored = client.responses.create(model=name, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(stored.id)
    assert "background" in str(e.value) and "response_id" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")
    r = httpx.post(f"{server.url}/v1/responses/compact", json={"model": name, "input": "hi"},
                   timeout=30)  # fmt: skip
    assert r.status_code == 404 and "/v1/responses/compact" in r.text
