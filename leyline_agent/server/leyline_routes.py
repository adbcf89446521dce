"""``POST /leyline/v1/directives`` and ``GET /leyline/v1/stats``.

Everything that can be checked without the cache is checked here before the engine is
asked (model name, message shapes, token ids, directive spans against ``len(tokens)``), so
a refused request costs the engine nothing and changes none of its counters. What needs
the cache (is ``tokens`` cached?) is the engine's to say: ``CacheMissError`` -> 409.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ValidationError

from leyline_agent.directives import plan_batch
from leyline_agent.server.completions import check_prompt_ids, messages_for_template
from leyline_agent.server.errors import RequestError, field_path
from leyline_agent.server.openai_api import ChatMessage, ToolSpec
from leyline_agent.server.state import state
from leyline_agent.wire import DirectivesRequest, DirectivesResponse, StatsResponse

__all__ = ["router"]

router = APIRouter()


def _check_messages(messages: list[dict], name: str) -> None:
    for i, raw in enumerate(messages):
        try:
            ChatMessage.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            raise RequestError(
                err.get("msg", "invalid message"), field_path((name, i, *err["loc"]))
            ) from e


def checked(req: DirectivesRequest, request: Request) -> DirectivesRequest:
    """``req`` validated against the served model, ready for the engine."""
    st = state(request)
    st.model.check(req.model)
    if req.tokens is not None and req.directives is not None:
        check_prompt_ids(req.tokens, st.model.limits, "tokens")
        plan_batch(req.directives, seq_len=len(req.tokens))  # raises naming directives[i]
        for i, d in enumerate(req.directives):
            if isinstance(d.replacement, list) and d.replacement:
                check_prompt_ids(d.replacement, st.model.limits, f"directives[{i}].replacement")
        return req
    assert req.old_messages is not None and req.new_messages is not None  # the model's invariant
    _check_messages(req.old_messages, "old_messages")
    _check_messages(req.new_messages, "new_messages")
    for i, tool in enumerate(req.tools or []):
        try:
            ToolSpec.model_validate(tool)
        except ValidationError as e:
            raise RequestError(e.errors()[0].get("msg", "invalid tool"), f"tools[{i}]") from e
    return req.model_copy(
        update={
            "old_messages": messages_for_template(req.old_messages),
            "new_messages": messages_for_template(req.new_messages),
        }
    )


@router.post("/leyline/v1/directives", response_model=DirectivesResponse)
async def directives(req: DirectivesRequest, request: Request) -> DirectivesResponse:
    ready = checked(req, request)
    return await state(request).scheduler.run(lambda engine: engine.apply_directives(ready))


@router.get("/leyline/v1/stats", response_model=StatsResponse)
async def stats(request: Request) -> StatsResponse:
    return await state(request).scheduler.run(lambda engine: engine.stats())
