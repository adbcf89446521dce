"""Errors read by the real OpenAI SDK: ``param`` and ``code`` set, 400 for a bad request.

The SDK takes ``body["error"]`` apart into ``.type``, ``.param``, ``.code``; these tests
read them there, as an application would.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.server.errors import exception_response

HELLO = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("kwargs", "type_", "param", "code"),
    [
        ({"messages": HELLO, "n": 2}, "RequestError", "n", "invalid_value"),
        ({"messages": HELLO, "max_tokens": 0}, "ValidationError", "max_tokens", "greater_than_equal"),
        ({"messages": HELLO, "temperature": "hot"}, "ValidationError", "temperature", "float_type"),
        ({"messages": []}, "ValidationError", "messages", "too_short"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "RequestError", "messages[0].role", "invalid_value"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_with_param_and_code(client, name, kwargs, type_, param, code):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, **kwargs)
    assert e.value.status_code == 400
    assert (e.value.type, e.value.param, e.value.code) == ("invalid_request_error", param, code)
    assert e.value.body["leyline_type"] == type_
    assert param in e.value.message


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert (e.value.param, e.value.code) == ("model", "model_not_found")
    assert e.value.type == "invalid_request_error"  # what OpenAI answers for an unknown model


def test_error_body_has_openai_keys_and_the_leyline_field(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "x"}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    assert err["param"] == err["field"] == "messages" and err["code"] == "missing"


def test_a_missing_directive_base_is_409_cache_miss(server, name):
    body = {"tokens": [5, 6, 7, 8], "directives": [{"start": 1, "end": 2, "replacement": [9]}]}
    r = httpx.post(
        f"{server.url}/leyline/v1/directives", json={**body, "fallback": False}, timeout=30
    )
    assert r.status_code == 409
    err = r.json()["error"]
    assert (err["type"], err["leyline_type"], err["code"]) == (
        "invalid_request_error",
        "CacheMissError",
        "cache_miss",
    )


def test_one_model_not_found_error_for_every_route():
    """``leyline serve`` and the vLLM plugin check the model with the same function
    (``directives.validate.check_served``), answered 404 naming ``model`` by both mappings."""
    from leyline_agent.directives import answers  # the directive service's (the plugins')
    from leyline_agent.directives.validate import check_served
    from leyline_agent.errors import InvalidRequestError, ModelNotFoundError
    from leyline_agent.server import errors as serve_errors

    check_served(None, "m")
    check_served("alias", "m", ["alias"])
    with pytest.raises(ModelNotFoundError) as info:
        check_served("x", "m", ["alias"])
    exc = info.value
    assert isinstance(exc, InvalidRequestError) and exc.field == "model"
    message = "model: the model 'x' does not exist; this server serves 'm'"
    want = (404, "ModelNotFoundError", message, "model")
    assert serve_errors.classify(exc) == want
    assert answers.classify(exc) == want


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeUnavailableError("the server is shutting down; no new work accepted"),
        concurrent.futures.CancelledError(),
    ],
    ids=["worker-closed", "cancelled"],
)
def test_every_503_says_when_to_retry(exc):
    # what a request that reaches a route once the shutdown deadline has passed is answered
    response = exception_response(exc)
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert json.loads(response.body)["error"]["type"] == "server_error"
