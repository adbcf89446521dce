"""Inputs that used to pass silently, refused over HTTP with a 400 naming the field (while the
harness watches ``/health`` and another tenant's stream). The other strict cases live beside
their area: remote / ``file:`` ``$ref`` and tool schemas under every ``tool_choice`` in
``test_hostile_schemas.py``, ``leyline.edits[].index: "3"`` in ``test_hostile_text.py``.

- a ``function_call_output`` whose ``call_id`` no earlier ``function_call`` has (in the input,
  or in the stored response it continues) is a 400 naming ``input[k].call_id``; one that
  answers a call of the previous response is served.
"""

from __future__ import annotations

RESPONSES = "/v1/responses"
CALL = {"type": "function_call", "call_id": "call_1", "name": "run", "arguments": "{}"}
TOOLS = [{"type": "function", "name": "run", "parameters": {"type": "object", "properties": {}}}]


def _body(name: str, items: list[dict], **extra) -> dict:
    body = {"model": name, "input": items, "max_output_tokens": 2, "temperature": 0}
    return {**body, "tools": TOOLS, "store": False, **extra}


def _output(call_id: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": "done"}


def test_an_unmatched_function_call_output_is_refused(hostile, post, served_name):
    items = [{"role": "user", "content": "Run it."}, CALL, _output("call_1"), _output("call_2")]
    answer = hostile(lambda: post(RESPONSES, _body(served_name, items)), field="input[3].call_id")
    assert "call_2" in answer.response.json()["error"]["message"]


def test_an_output_answering_the_previous_responses_call_is_served(post, served_name):
    first = post(
        RESPONSES, _body(served_name, [{"role": "user", "content": "Run it."}, CALL], store=True)
    )
    assert first.status_code == 200, first.text
    items = [_output("call_1")]
    r = post(RESPONSES, _body(served_name, items, previous_response_id=first.json()["id"]))
    assert r.status_code == 200, r.text
    assert post(RESPONSES, _body(served_name, [_output("call_1")])).status_code == 400
