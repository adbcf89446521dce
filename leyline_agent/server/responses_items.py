"""The Responses API's smaller routes on ``leyline serve``: served, or refused by name.

- ``GET /v1/responses/{id}/input_items``: the input of a stored response, as items (OpenAI's
  list: ``data``, ``first_id``, ``last_id``, ``has_more``; ``limit`` 1-100, default 20;
  ``order`` ``desc`` (default) or ``asc``; ``after`` an item id). The input is the
  conversation the response was generated from (its ``previous_response_id`` chain
  included, instructions not: the store keeps no instructions), as ``message``,
  ``function_call`` and ``function_call_output`` items; an item's id is the response's id and
  its position, so pages are stable.
- ``POST /v1/responses/{id}/cancel``: only a background response can be cancelled, and this
  server runs none (``background: true`` is refused when a response is created): a stored
  response is a 400 naming ``response_id``, an unknown one a 404.
- ``POST /v1/responses/input_tokens``: ``{"object": "response.input_tokens", "input_tokens":
  n}``, the prompt a ``POST /v1/responses`` with this body would render
  (``messages_routes.count_prompt``: the served template, nothing generated).
- ``POST /v1/responses/compact``: a 404 naming the route: compaction writes an opaque
  summary item this server cannot produce (server-side edits are ``context_management``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from leyline_agent.front.messages import parse_request
from leyline_agent.server.errors import RequestError
from leyline_agent.server.inputs import raw_json_body
from leyline_agent.server.messages_routes import count_prompt
from leyline_agent.server.openai_api import ChatCompletionRequest
from leyline_agent.server.responses_api import ResponsesRequest, chat_request
from leyline_agent.server.responses_output import output_items
from leyline_agent.server.responses_routes import (
    ResponseNotFoundError,
    responses_store,
    stored,
)
from leyline_agent.server.tenants import namespace

__all__ = ["input_items", "router"]

router = APIRouter()
MAX_LIMIT = 100
_CHAT_FIELDS = frozenset(ChatCompletionRequest.model_fields)


def input_items(response_id: str, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items of a stored response (module doc); ``conversation``: its chat
    messages, reply included (left out here)."""
    out: list[dict[str, Any]] = []
    for m in conversation[:-1]:
        role = m.get("role")
        if role == "assistant":
            out.extend(output_items(m))
        elif role == "tool":
            out.append({"type": "function_call_output", "call_id": m.get("tool_call_id"),
                        "output": m.get("content") or "", "status": "completed"})  # fmt: skip
        else:
            text = m.get("content") or ""
            part = {"type": "input_text", "text": text if isinstance(text, str) else str(text)}
            out.append({"type": "message", "role": role, "status": "completed",
                        "content": [part]})  # fmt: skip
    return [{**item, "id": f"{response_id}_item{k}"} for k, item in enumerate(out)]


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = 20,
    order: str = "desc",
    after: str | None = None,
    include: list[str] | None = None,
) -> dict[str, Any]:
    if not 1 <= limit <= MAX_LIMIT:
        raise RequestError(f"must be in [1, {MAX_LIMIT}]", "limit")
    if order not in ("asc", "desc"):
        raise RequestError("must be 'asc' or 'desc'", "order")
    if include:
        raise RequestError("no input item carries extra content here", "include")
    found = await stored(request, response_id)
    if found is None:
        raise ResponseNotFoundError(f"no stored response {response_id!r}", "response_id")
    items = input_items(response_id, found.conversation)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise RequestError(f"no input item {after!r} in this response", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Any:
    if not responses_store(request).has(namespace(request).tenant, response_id):
        raise ResponseNotFoundError(f"no stored response {response_id!r}", "response_id")
    raise RequestError(
        "only background responses can be cancelled, and this server runs none "
        "(every stored response is complete)",
        "response_id",
    )


class RouteNotServedError(RequestError):
    status = 404


@router.post("/v1/responses/compact", openapi_extra=raw_json_body(ResponsesRequest))
async def compact(request: Request) -> Any:
    raise RouteNotServedError(
        "POST /v1/responses/compact is not served: compaction writes an opaque summary item "
        "this server cannot produce (server-side context edits: context_management)",
        "/v1/responses/compact",
    )


@router.post("/v1/responses/input_tokens", openapi_extra=raw_json_body(ResponsesRequest))
async def input_tokens(request: Request) -> Any:
    """The prompt tokens the body would render as ``POST /v1/responses`` (its
    ``previous_response_id`` chain included), counted without generating."""
    req = parse_request(ResponsesRequest, request.state.json_body)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = await stored(request, req.previous_response_id)
        if found is None:
            raise RequestError(
                f"no stored response {req.previous_response_id!r}", "previous_response_id"
            )
        history = found.conversation
    body = chat_request(req, history, set(_CHAT_FIELDS))[0]
    chat = parse_request(ChatCompletionRequest, {**body, "stream": False})
    counted = await count_prompt(request, chat)
    return {"object": "response.input_tokens", "input_tokens": counted["input_tokens"]}
