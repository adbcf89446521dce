"""``/v1/responses``: OpenAI's Responses API, served through the chat route.

``POST /v1/responses`` checks the request (``responses_api``), prepends the stored
conversation of its ``previous_response_id`` (``responses_store``; unknown, or another
tenant's: a 400 naming the field), and calls the chat route's own handler with the chat
request it becomes, so the prompt is rendered, edited, spliced and generated exactly as a
chat request with the same messages would be. The chat answer (or its stream) is turned
into a Response (or the Responses event stream, ``responses_output``), and, unless
``store`` is false, the response and its conversation are stored for the tenant.

``GET /v1/responses/{id}`` answers a stored response; ``DELETE`` forgets it. An unknown id is
a 404 (``not_found_error``). The store is bounded per tenant in entries, bytes and time
(``responses_store.StoreLimits``, least recently used first out): a chain whose head was
forgotten is a 400, never a silent fresh start; a request that would store more than an entry
may hold, or ``metadata`` / ``user`` / ``text`` past OpenAI's bounds, is a 400 naming it.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from leyline_agent.errors import InvalidRequestError
from leyline_agent.http.offload import off_loop
from leyline_agent.http_errors import field_path
from leyline_agent.server.errors import RequestError
from leyline_agent.server.inputs import ParsedBodyRoute
from leyline_agent.server.openai_api import ChatCompletionRequest
from leyline_agent.server.openai_routes import chat_completions
from leyline_agent.server.request_fields import fields_check, ignore
from leyline_agent.server.responses_api import (
    ResponsesRequest,
    chat_request,
    responses_field,
    tool_namespaces,
)
from leyline_agent.server.responses_output import (
    ResponseEvents,
    new_item_id,
    output_items,
    reply_message,
    response_object,
    responses_usage,
)
from leyline_agent.server.responses_store import (
    ResponseStore,
    StoredResponse,
    check_request,
    entry_bytes,
)
from leyline_agent.server.session_names import name_session
from leyline_agent.server.state import state
from leyline_agent.server.template_options import template_reads
from leyline_agent.server.tenants import namespace

__all__ = ["ResponseNotFoundError", "responses_store", "router", "stored"]

router = APIRouter(route_class=ParsedBodyRoute)  # a large body parsed off the loop


class ResponseNotFoundError(RequestError):
    status = 404


def responses_store(request: Request) -> ResponseStore:
    """The app's store (``create_app`` makes it; one is made here for an app that did not)."""
    app_state = request.app.state
    store = getattr(app_state, "leyline_responses", None)
    if store is None:
        store = app_state.leyline_responses = ResponseStore()
    return store


@router.post("/v1/responses", dependencies=[Depends(fields_check("responses", ResponsesRequest))])
async def create_response(req: ResponsesRequest, request: Request) -> Any:
    st, tenant = state(request), namespace(request).tenant
    st.model.check(req.model)
    # Codex names its thread in both; X-Leyline-Session wins (session_names)
    name_session(request, req.prompt_cache_key, "prompt_cache_key")
    name_session(request, request.headers.get("session-id"), "session-id")
    store = responses_store(request)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = await stored(request, req.previous_response_id)
        if previous is None:
            raise RequestError(
                f"no stored response {req.previous_response_id!r} (unknown, deleted, or "
                "forgotten: the store keeps the newest responses of each tenant)",
                "previous_response_id",
            )
        history = previous.conversation
    check_request(  # what it would store, bounded before it runs (responses_store)
        store=req.store,
        metadata=req.metadata,
        user=req.user,
        text=req.text,
        stored_bytes=await off_loop(entry_bytes, req.input, history) if req.store else 0,
        limits=store.limits,
    )
    effort = template_reads(st.worker.engine, "reasoning_effort")
    body, conversation, notes = chat_request(
        req, history, set(ChatCompletionRequest.model_fields), effort
    )
    chat = _chat(body)
    ignore(request, notes)  # listed in the chat answer's leyline.ignored
    head = _head(new_item_id("resp"), st.model.id, req)

    async def save(response: dict[str, Any], reply: dict[str, Any]) -> None:
        if req.store:  # a file of up to an entry's bytes, written off the loop
            entry = StoredResponse(response, [*conversation, reply])
            await off_loop(store.put, tenant, response["id"], entry)

    try:
        answer = await chat_completions(chat, request)
    except InvalidRequestError as e:  # named as the client named it
        raise _renamed(e) from None
    if req.stream:
        return StreamingResponse(
            _events(answer, head, save, tool_namespaces(req.tools)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    data = json.loads(answer.body)
    choice = data["choices"][0]
    items = output_items(choice["message"], tool_namespaces(req.tools))
    extra = {k: data[k] for k in ("leyline", "context_management") if k in data}
    response = response_object(
        head,
        items,
        usage=responses_usage(data["usage"]),
        finish_reason=choice["finish_reason"],
        extra=extra,
    )
    await save(response, reply_message(items))
    return JSONResponse(response)


async def stored(request: Request, response_id: str) -> StoredResponse | None:
    """The tenant's stored response ``response_id``, read from its file off the event loop;
    None if it is not stored."""
    store, tenant = responses_store(request), namespace(request).tenant
    return await off_loop(store.get, tenant, response_id)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Any:
    found = await stored(request, response_id)
    if found is None:
        raise ResponseNotFoundError(f"no stored response {response_id!r}", "response_id")
    return JSONResponse(found.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Any:
    store, tenant = responses_store(request), namespace(request).tenant
    if not await off_loop(store.delete, tenant, response_id):
        raise ResponseNotFoundError(f"no stored response {response_id!r}", "response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _renamed(e: InvalidRequestError) -> InvalidRequestError:
    field = responses_field(e.field)
    if field == e.field:
        return e
    out = copy.copy(e)  # same class, so the same status
    out.field, out.args = field, (f"{field}: {e.detail}",)
    return out


def _chat(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        raise RequestError(err.get("msg", "invalid value"), field_path(err.get("loc", ()))) from e


def _head(response_id: str, model: str, req: ResponsesRequest) -> dict[str, Any]:
    """The fields of a Response that echo the request."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": time.time(),
        "model": model,
        "error": None,
        "instructions": req.instructions,
        "previous_response_id": req.previous_response_id,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "store": req.store,
        "text": req.text or {"format": {"type": "text"}},
        "truncation": "disabled",
        "user": req.user,
        "background": False,
    }


async def _events(
    answer: StreamingResponse,
    head: dict[str, Any],
    save: Callable[[dict[str, Any], dict[str, Any]], Awaitable[None]],
    namespaces: dict[str, str],
) -> AsyncIterator[str]:
    """The Responses events of the chat route's stream ``answer``."""
    out = ResponseEvents(head, namespaces)
    for event in out.start():
        yield event
    async with aclosing(answer.body_iterator) as frames:
        async for frame in frames:
            for line in str(frame).splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[len("data: ") :])
                if "error" in payload:
                    for event in out.failed(payload["error"]):
                        yield event
                    return
                for event in out.chunk(payload):
                    yield event
    events = out.finish()
    await save(out.response, out.reply())  # stored before the client reads it completed
    for event in events:
        yield event
