"""Checks on the JSON body that run before any field model or template sees it.

Text that is not Unicode:

Python's ``json`` module accepts what strict JSON parsers refuse: an escaped lone surrogate
(``"abc\\ud800def"``: a string that cannot be encoded as UTF-8, which the tokenizer then
fails on) and the non-standard ``NaN`` / ``Infinity`` literals (and numbers such as
``1e400`` that overflow to infinity). ``check_json_text`` walks the whole body, iteratively
(a deeply nested body cannot exhaust the stack), and refuses the first such value with a
400 naming its path (``messages[0].content``), before any field is used. The walk, and the
parse of a body a route parses itself, run off the event loop (``offload``): a 16 MiB body
takes a core for a second, during which the loop answers other requests.

A route with a body model (``/v1/chat/completions``, ``/v1/responses``) has its body parsed
by FastAPI before any dependency runs; its router's ``ParsedBodyRoute`` hands FastAPI a
request whose ``json()`` parses a body of ``http_guards.OFF_LOOP_BODY_BYTES`` or more off the loop with
``http.json_parse.loads`` (which lets the loop run meanwhile even on a body of millions of
small values, where ``json.loads`` would hold the GIL on any thread to its end, and refuses
a body of more than ``MAX_JSON_VALUES`` values: a 400 naming ``body``).

Bounds and shapes of message lists (``messages``, a directive's ``old_messages`` /
``new_messages``, the Responses API's ``input``), checked by ``check_message_lists`` before
the body is validated, so a huge chat costs a length check, not a render:

- at most ``InputLimits.max_messages`` messages (``leyline serve --max-messages``);
- at most as much text as ``max_prompt_tokens`` tokens can hold (``limits.check_text_bound``:
  a byte-level tokenizer's longest token bounds the tokens from below);
- a ``user``, ``system`` or ``developer`` message has ``content`` (null or missing: 400
  naming ``messages[i].content``; an empty string is content).

A body that is not JSON, sent to a route that reads no body (``/leyline/v1/flush``), is
refused too (400 naming ``body``), as is any body there but an empty one or ``{}``: such a
route has no field to take, and a field it would ignore is a request it would not honour.
(Routes with a body model get FastAPI's own 400 for text that is not JSON.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from leyline_agent.directives.validate import check_text_bound, message_text_bytes
from leyline_agent.http import guards as http_guards
from leyline_agent.http.json_parse import MAX_JSON_VALUES, TooManyValuesError, loads
from leyline_agent.http.offload import off_loop
from leyline_agent.server.errors import RequestError

__all__ = [
    "DEFAULT_MAX_MESSAGES",
    "InputLimits",
    "ParsedBodyRoute",
    "check_json_body",
    "check_json_text",
    "check_message_lists",
    "raw_json_body",
]

DEFAULT_MAX_MESSAGES = 4096
MESSAGE_LISTS = ("messages", "old_messages", "new_messages", "input")
NEEDS_CONTENT = frozenset({"user", "system", "developer"})


@dataclass(frozen=True, slots=True)
class InputLimits:
    max_messages: int = DEFAULT_MAX_MESSAGES
    longest_token_bytes: int | None = None  # None: no text bound before tokenizing
    max_prompt_tokens: int | None = None


def check_json_text(body: Any) -> None:
    """Raise ``RequestError`` naming the first lone surrogate, non-finite number or level
    past ``MAX_JSON_DEPTH`` (the shared walk of ``http.guards``)."""
    try:
        http_guards.check_json_text(body)
    except http_guards.GuardError as e:
        raise RequestError(e.detail, e.field) from e


def check_message_lists(body: Any, limits: InputLimits) -> None:
    """Raise ``RequestError`` naming the first message list (or message) out of bounds
    (see the module docstring); bodies and lists of other shapes are the models' to refuse."""
    if not isinstance(body, dict):
        return
    for name in MESSAGE_LISTS:
        messages = body.get(name)
        if not isinstance(messages, list):
            continue
        if len(messages) > limits.max_messages:
            raise RequestError(
                f"{len(messages)} messages; the limit is {limits.max_messages}", name
            )
        check_text_bound(
            message_text_bytes(messages), limits.longest_token_bytes, limits.max_prompt_tokens, name
        )
        for i, m in enumerate(messages):
            if isinstance(m, dict) and m.get("role") in NEEDS_CONTENT and m.get("content") is None:
                raise RequestError(f"a {m['role']} message needs content", f"{name}[{i}].content")


async def check_json_body(request: Request) -> None:
    """Route dependency: check the body FastAPI parsed (``request.json()`` is cached). A
    route that parses its body itself (``RAW_JSON_BODY`` in its ``openapi_extra``) gets it
    parsed by ``http_guards.parse_json``, as every Leyline front parses it, in
    ``request.state.json_body`` (None for an empty body)."""
    if request.method not in ("POST", "PUT", "PATCH"):
        return
    route = request.scope.get("route")
    takes_body = getattr(route, "body_field", None) is not None
    takes_raw = "requestBody" in (getattr(route, "openapi_extra", None) or {})
    raw = await request.body()
    limits = getattr(getattr(request.app.state, "leyline", None), "inputs", None)
    limits = limits if isinstance(limits, InputLimits) else InputLimits()
    if takes_raw:
        body = await http_guards.parse_body(raw)
        request.state.json_body = body
        check_message_lists(body, limits)
        return
    if not takes_body and not raw.strip():
        return
    try:
        body = await request.json()
    except (ValueError, RecursionError) as e:
        if takes_body:  # the route's body model says what is wrong (missing, not JSON)
            return
        raise RequestError(f"the body is not valid JSON ({type(e).__name__})", "body") from e
    if not takes_body and body != {}:
        raise RequestError("this route takes no fields; send no body or {}", "body")
    check_message_lists(body, limits)
    await off_loop(check_json_text, body)


def raw_json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route that parses its JSON body itself (``check_json_body``
    hands it over), documenting ``model`` as the body."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


class _OffLoopJSONRequest(Request):
    """A request whose large JSON body is parsed off the event loop (module doc)."""

    _leyline_json: Any
    _leyline_error: Exception | None = None

    async def parse_large(self) -> None:
        """Parse a body of ``OFF_LOOP_BODY_BYTES`` or more off the loop, for ``json()``; past
        ``json_parse.MAX_JSON_VALUES`` values, a 400 naming ``body``. A body that is not JSON
        raises its error from ``json()``, where FastAPI answers it as it always does."""
        raw = await self.body()
        if len(raw) < http_guards.OFF_LOOP_BODY_BYTES:
            return
        try:
            self._leyline_json = await off_loop(loads, raw)
        except TooManyValuesError as e:
            raise RequestError(f"{e}; a request has at most {MAX_JSON_VALUES}", "body") from None
        except (ValueError, RecursionError) as e:
            self._leyline_error = e

    async def json(self) -> Any:
        if self._leyline_error is not None:
            raise self._leyline_error
        if not hasattr(self, "_leyline_json"):
            self._leyline_json = json.loads(await self.body())  # small: parse_large
        return self._leyline_json


class ParsedBodyRoute(APIRoute):
    """The route class of routers whose routes have a body model (module doc)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parsed(request: Request) -> Response:
            ours = _OffLoopJSONRequest(request.scope, request.receive)
            await ours.parse_large()
            return await handler(ours)

        return parsed
