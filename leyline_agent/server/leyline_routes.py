"""``POST /leyline/v1/directives``, ``GET /leyline/v1/stats`` and ``POST /leyline/v1/flush``.

Everything that can be checked without the cache is checked here before the engine is
asked (model name, message shapes, token ids, directive spans against ``len(tokens)``), so
a refused request costs the engine nothing and changes none of its counters. What needs
the cache (is ``tokens`` cached?) is the engine's to say: ``CacheMissError`` -> 409.
A message-form FORGET also updates the conversations it edits (``ConversationStore.forgotten``),
so the chat request that sends the edited history is not taken for a client edit; a
token-form FORGET in a named session marks that session's conversations exact
(``ConversationStore.mark_exact``: their detected edits are FORGETs).
A directive runs in its session's order (``worker.session_key``): never in the middle of
another request of the same session; the engine runs it between two steps of the others.

Each request acts in its namespace: the key's tenant, and the session named by the
``X-Leyline-Session`` header or the ``session`` field. A directive whose client left before
it started is not executed. A ``request_id`` makes retries idempotent
(``directive_memory``); ``/leyline/v1/stats`` answers the caller's tenant's counters.
``/leyline/v1/flush`` (like SGLang's ``/flush_cache``) empties the caller's tenant's part of
the prefix cache (rows a request in flight holds stay until it ends), its pins and its
conversations; other tenants and every counter are untouched.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from leyline_agent.chat_input import canonical_tools
from leyline_agent.directives import Directive, Mode
from leyline_agent.directives.flush import FlushResponse
from leyline_agent.server.completions import (
    check_message_shapes,
    check_prompt_ids,
    check_prompt_length,
    messages_for_template,
)
from leyline_agent.server.directive_memory import check_request_id
from leyline_agent.server.disconnect import run_connected
from leyline_agent.server.errors import RequestError
from leyline_agent.server.limits import check_text_bound, message_text_bytes
from leyline_agent.server.openai_api import ToolSpec
from leyline_agent.server.state import state
from leyline_agent.server.tenants import namespace
from leyline_agent.server.worker import session_key
from leyline_agent.wire import BODY_EDITS, DirectivesRequest, DirectivesResponse, StatsResponse

__all__ = ["FlushResponse", "router"]

router = APIRouter()


def checked(req: DirectivesRequest, request: Request) -> DirectivesRequest:
    """``req`` validated against the served model, ready for the engine."""
    st = state(request)
    st.model.check(req.model)
    if req.tokens is not None and req.directives is not None:
        check_prompt_length(len(req.tokens), st.model, "tokens")
        check_prompt_ids(req.tokens, st.model.limits, "tokens")
        check_directive_sizes(req.tokens, req.directives, st.model)
        for i, d in enumerate(req.directives):
            if isinstance(d.replacement, list) and d.replacement:
                check_prompt_ids(d.replacement, st.model.limits, f"directives[{i}].replacement")
        return req
    assert req.old_messages is not None and req.new_messages is not None  # the model's invariant
    check_message_shapes(req.old_messages, "old_messages")
    check_message_shapes(req.new_messages, "new_messages")
    longest, limit = st.model.limits.longest_token_bytes, st.model.max_prompt_tokens
    for name, messages in (("old_messages", req.old_messages), ("new_messages", req.new_messages)):
        check_text_bound(message_text_bytes(messages), longest, limit, name)
    for i, tool in enumerate(req.tools or []):
        try:
            ToolSpec.model_validate(tool)
        except ValidationError as e:
            raise RequestError(e.errors()[0].get("msg", "invalid tool"), f"tools[{i}]") from e
    return req.model_copy(
        update={
            "old_messages": messages_for_template(req.old_messages),
            "new_messages": messages_for_template(req.new_messages),
            "tools": canonical_tools(req.tools),  # as the chat route renders them
        }
    )


def check_directive_sizes(tokens: list[int], directives: list[Directive], model: Any) -> None:
    """Refuse, before any prefill, a replacement or a resulting sequence longer than the
    server's ``max_prompt_tokens`` (the model's context unless set lower): such a splice
    would hold the engine for its R prefill and leave rows no completion may use. A text
    replacement is counted from below (its bytes over the longest token's) before it is
    tokenized, so a huge text is refused without tokenizing it."""
    limit = model.max_prompt_tokens
    if limit is None:
        return
    longest = model.limits.longest_token_bytes
    length, from_below = len(tokens), False
    for i, d in enumerate(directives):
        field = f"directives[{i}].replacement"
        if isinstance(d.replacement, str):
            n_bytes = len(d.replacement.encode("utf-8", "surrogatepass"))
            check_text_bound(n_bytes, longest, limit, field)
            n, from_below = (n_bytes // longest if longest else 0), True
        else:
            n = len(d.replacement)
            if n > limit:
                raise RequestError(f"the replacement has {n} tokens; the limit is {limit}", field)
        length += n - (d.end - d.start)
    if length > limit:
        raise RequestError(
            f"the spliced sequence would have {'at least ' * from_below}{length} tokens; "
            f"the limit is {limit}",
            "directives",
        )


@router.post("/leyline/v1/directives", response_model=DirectivesResponse)
async def directives(req: DirectivesRequest, request: Request) -> DirectivesResponse:
    st = state(request)
    ns = namespace(request, req.session)
    check_request_id(req.request_id)
    ready = checked(req, request).model_copy(update={"session": ns.session})
    memory = st.directive_memory

    def job(engine: Any) -> DirectivesResponse:  # on the worker: lookup + execute, atomic
        out = memory.run(req, ns, lambda: engine.apply_directives(ready, namespace=ns))
        if ready.mode == Mode.FORGET and ready.old_messages is not None:
            # the conversation takes the edited messages: its next chat request continues
            # it as it is, so no client edit amortizes the forgotten span back
            assert ready.new_messages is not None
            st.conversations.forgotten(ns.tenant, ns.session, ready.old_messages, ready.new_messages)
        forgets = any(d.mode == Mode.FORGET for d in ready.directives or [])
        if forgets and ns.session is not None:  # token form: the session's edits stay exact
            st.conversations.mark_exact(ns.tenant, ns.session)
        return out

    return await run_connected(request, st.worker, job, key=session_key(ns))


@router.get("/leyline/v1/stats", response_model=StatsResponse)
async def stats(request: Request) -> StatsResponse:
    tenant = namespace(request).tenant
    counts = await run_connected(request, state(request).worker, lambda e: e.stats(tenant=tenant))
    return counts.model_copy(update={"features": (BODY_EDITS,)})  # request_edits applies them


@router.post("/leyline/v1/flush", response_model=FlushResponse)
async def flush(request: Request) -> FlushResponse:
    st = state(request)
    tenant = namespace(request).tenant

    def job(engine: Any) -> FlushResponse:  # on the worker: between two engine steps
        rep = engine.cache.flush(tenant)
        return FlushResponse(
            tenant=tenant,
            flushed_tokens=rep.flushed_tokens,
            kept_tokens=rep.kept_tokens,
            dropped_pins=rep.dropped_pins,
            dropped_conversations=st.conversations.forget_tenant(tenant),
        )

    return await run_connected(request, st.worker, job)
