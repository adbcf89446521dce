"""``/v1/messages`` and ``/v1/messages/count_tokens`` on ``leyline serve``: Anthropic's
Messages API, served through the chat route.

``POST /v1/messages`` checks the body (``front.messages``), calls the chat route's own handler
with the chat request it becomes, and turns the chat answer (or its stream) into a Message
(or Anthropic's event stream). So a Messages request is rendered, edited, spliced and
generated exactly as the chat request with the same messages would be, and its
``context_management`` edits are spliced by the chat turn (``front.chat_turn``). Anthropic's
hints (``front.messages.ignored_fields``) are listed in the answer's ``leyline.ignored``,
counted and logged, as the OpenAI routes' are (``request_fields``).

``POST /v1/messages/count_tokens`` answers ``input_tokens``: the prompt the request renders
with the served template; with ``context_management``, the prompt after the edits that would
trigger on it as a fresh conversation (``front.turns.plan_turn``: pure, nothing spliced), and
``context_management.original_input_tokens`` the prompt before them, as Anthropic answers;
its hints are listed in ``leyline.ignored`` too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from leyline_agent.chat_input import canonical_messages
from leyline_agent.front.messages import (
    CountTokensRequest,
    MessageEvents,
    MessagesRequest,
    chat_body,
    count_input_tokens,
    ignored_fields,
    message_answer,
    parse_request,
    with_ignored,
)
from leyline_agent.server.completions import check_messages, messages_for_template
from leyline_agent.server.disconnect import run_connected
from leyline_agent.server.inputs import raw_json_body
from leyline_agent.server.openai_api import ChatCompletionRequest
from leyline_agent.server.openai_routes import chat_completions
from leyline_agent.server.request_fields import Ignored, ignore
from leyline_agent.server.state import state

__all__ = ["count_prompt", "router"]

router = APIRouter()
_CHAT_FIELDS = frozenset(ChatCompletionRequest.model_fields)


@router.post("/v1/messages", openapi_extra=raw_json_body(MessagesRequest))
async def create_message(request: Request) -> Response:
    req = parse_request(MessagesRequest, request.state.json_body)
    chat = parse_request(ChatCompletionRequest, chat_body(req, _CHAT_FIELDS))
    _ignore_hints(request, req)  # the chat answer lists them in leyline.ignored
    model = state(request).model.id
    answer = await chat_completions(chat, request)
    if not req.stream:
        return JSONResponse(message_answer(json.loads(answer.body), model))
    assert isinstance(answer, StreamingResponse)
    return StreamingResponse(
        _events(answer, MessageEvents(model)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


@router.post("/v1/messages/count_tokens", openapi_extra=raw_json_body(CountTokensRequest))
async def count_tokens(request: Request) -> Response:
    req = parse_request(CountTokensRequest, request.state.json_body)
    chat = parse_request(ChatCompletionRequest, chat_body(req, _CHAT_FIELDS))
    notes = _ignore_hints(request, req)
    return JSONResponse(with_ignored(await count_prompt(request, chat), notes))


def _ignore_hints(
    request: Request, req: CountTokensRequest | MessagesRequest
) -> list[dict[str, str]]:
    """Anthropic's hints in ``req`` (``ignored_fields``), counted and logged as the OpenAI
    routes' are; returned as ``leyline.ignored`` lists them."""
    notes = ignored_fields(req)
    ignore(request, [Ignored(n["field"], n["reason"]) for n in notes])
    return notes


async def count_prompt(request: Request, chat: ChatCompletionRequest) -> dict[str, Any]:
    """``{"input_tokens": n}``: the tokens of the prompt ``chat`` renders with the served
    template; with ``context_management``, of the prompt after the edits that would trigger
    on it as a fresh conversation (pure: nothing is spliced), and
    ``context_management.original_input_tokens`` the prompt before them (module doc)."""
    st = state(request)
    st.model.check(chat.model)
    tools = check_messages(chat)
    messages = messages_for_template(chat.messages)

    def counted(engine: Any) -> dict[str, Any]:
        def n(ms: list[dict[str, Any]]) -> int:
            return len(engine.render(ms, tools=tools, add_generation_prompt=True))

        def count(text: str) -> int:
            return len(engine.tokenizer.encode(text, add_special_tokens=False)) if text else 0

        canon = canonical_messages(chat.messages)
        return count_input_tokens(messages, canon, chat.context_management, tools, n, count)

    return await run_connected(request, st.worker, counted)


async def _events(answer: StreamingResponse, out: MessageEvents) -> AsyncIterator[str]:
    """Anthropic's events for the chat route's stream ``answer``."""
    for item in out.start():
        yield item
    async with aclosing(answer.body_iterator) as frames:
        async for frame in frames:
            text = frame if isinstance(frame, str) else bytes(frame).decode()
            for line in text.splitlines():
                for item in out.line(line):
                    yield item
                if out.ended:
                    return
    for item in out.finish():
        yield item
