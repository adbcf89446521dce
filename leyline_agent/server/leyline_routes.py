"""``POST /leyline/v1/directives``, ``GET /leyline/v1/stats`` and ``POST /leyline/v1/flush``.

A directive goes through ``directives.service.DirectiveService``, the front door every
Leyline server mounts: everything that can be checked without the cache is checked before
the engine is asked (``admit``: the body, ``request_id``, model name, message shapes, token
ids, sizes), so a refused request costs the engine nothing and changes none of its
counters; then, in one worker job, ``run`` (idempotence, compile, lookup, decide, execute,
counters) over the engine's backend (``engine.executor.EngineDirectives``). What needs the
cache (is ``tokens`` cached?) is the engine's to say: ``CacheMissError`` -> 409.
A message-form FORGET also updates the conversations it edits (``ConversationStore.forgotten``),
so the chat request that sends the edited history is not taken for a client edit; a
token-form FORGET in a named session marks that session's conversations exact
(``ConversationStore.mark_exact``: their detected edits are FORGETs).
A directive runs in its namespace's order (the worker's job key is its namespace, the same
key as a named session's chat requests): never in the middle of another request of the same
session, nor beside another directive of its namespace (so a ``request_id`` retry waits for
the first run's answer); the engine runs it between two steps of the others.

Each request acts in its namespace: the key's tenant, and the session named by the
``X-Leyline-Session`` header or the ``session`` field. A directive whose client left before
it started is not executed. A ``request_id`` makes retries idempotent (the service's
memory is ``directive_memory``'s); ``/leyline/v1/stats`` answers the caller's tenant's counters.
``/leyline/v1/flush`` (like SGLang's ``/flush_cache``) empties the caller's tenant's part of
the prefix cache (rows a request in flight holds stay until it ends), its pins and its
conversations; other tenants and every counter are untouched.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from leyline_agent.directives.flush import FlushResponse
from leyline_agent.directives.service import DirectiveService, ServedModel, run_inline
from leyline_agent.http.offload import off_loop
from leyline_agent.server.disconnect import run_connected
from leyline_agent.server.inputs import raw_json_body
from leyline_agent.server.responses_routes import responses_store
from leyline_agent.server.state import state
from leyline_agent.server.tenants import key_owner, namespace
from leyline_agent.server.worker import ServedEngine
from leyline_agent.wire import (
    BODY_EDITS,
    CLIENT_EDITS,
    DirectivesRequest,
    DirectivesResponse,
    StatsResponse,
)

__all__ = ["FlushResponse", "router"]

router = APIRouter()


@router.post(
    "/leyline/v1/directives",
    response_model=DirectivesResponse,
    openapi_extra=raw_json_body(DirectivesRequest),
)
async def directives(request: Request) -> DirectivesResponse:
    st, service = state(request), directive_service(request)
    ready, ns = service.admit(request.state.json_body, lambda s: namespace(request, s))

    def job(engine: ServedEngine) -> DirectivesResponse:  # on the worker: the service's run
        out = run_inline(service.run(ready, ns, engine.directive_backend))
        # what it forgot stays forgotten
        st.conversations.directive_ran(ns, ready, key_owner(request))
        return out

    return await run_connected(request, st.worker, job, key=ns)


def directive_service(request: Request) -> DirectiveService:
    """The app's ``DirectiveService`` (made on first use): the served model's name, aliases
    and limits, the engine's tokenizer, and ``directive_memory``'s request ids."""
    app_state = request.app.state
    service = getattr(app_state, "leyline_directives", None)
    if service is None:
        st = state(request)
        engine = st.worker.engine
        model = ServedModel(
            name=st.model.id,
            tokenizer=engine.tokenizer,
            limits=st.model.request_limits,
            message_boundary_id=engine.message_boundary_id,
            aliases=tuple(st.model.aliases),
        )
        service = DirectiveService(model, memory=st.directive_memory.memory)
        app_state.leyline_directives = service
    return service


@router.get("/leyline/v1/stats", response_model=StatsResponse)
async def stats(request: Request) -> StatsResponse:
    st, tenant = state(request), namespace(request).tenant
    counts = await run_connected(request, st.worker, lambda e: e.stats(tenant=tenant))
    stored, stored_bytes = responses_store(request).stats(tenant)
    return counts.model_copy(
        update={
            "features": (BODY_EDITS, CLIENT_EDITS),  # chat_context
            "ignored_fields": st.ignored.of(tenant),  # request_fields
            "stored_responses": stored,  # responses_store
            "stored_response_bytes": stored_bytes,
        }
    )


@router.post("/leyline/v1/flush", response_model=FlushResponse)
async def flush(request: Request) -> FlushResponse:
    st, responses = state(request), responses_store(request)
    tenant = namespace(request).tenant

    service = directive_service(request)

    def job(engine: ServedEngine) -> FlushResponse:  # on the worker: between two engine steps
        rows = run_inline(service.flush(tenant, engine.directive_backend))  # cache, memory
        return rows.model_copy(
            update={"dropped_conversations": st.conversations.forget_tenant(tenant)}
        )

    rows = await run_connected(request, st.worker, job)
    # the stored responses' files (up to 1,024 unlinks) on the offload pool, not the worker
    dropped = await off_loop(responses.forget_tenant, tenant)
    return rows.model_copy(update={"dropped_responses": dropped})
