"""``create_app(engine_or_worker, ...)``: the FastAPI application of ``leyline serve``.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (``openai_routes``),
``/v1/responses`` (``responses_routes``) and ``/v1/messages`` (``messages_routes``), both
served through the chat route,
``/leyline/v1/directives``, ``/leyline/v1/stats`` (``leyline_routes``), ``/health``.
Every engine call goes through one ``Worker``; an app built from an engine owns its
worker (``concurrency`` threads: by default 16 for a thread-safe engine, 1 for any other;
``worker.concurrency_for``) and closes it when the app shuts down.

``/metrics`` (Prometheus) and the access log: ``observability``.

Pure ASGI middleware, outermost first: ``AccessLog`` (request ids), ``HostAllowlist`` (only
with ``allowed_hosts``), ``AnthropicKeyHeader`` and ``BearerAuth`` (only with ``api_keys``;
the first lets ``/v1/messages`` take the key as ``x-api-key``), ``BodyLimit``,
``ErrorGuard``. So a request from a foreign ``Host`` or without a key is refused before its
body is read, and a body over the limit before it is parsed. The routers' dependency ``check_json_body`` then refuses text
that is not Unicode before any field is used.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI

from leyline_agent.front.context_management import CLIENT_EDIT_MODES
from leyline_agent.http import guards as http_guards
from leyline_agent.server import errors
from leyline_agent.server.completions import CHAT_DEFAULT_MAX_TOKENS, ModelLimits, ServedModel
from leyline_agent.server.directive_memory import DEFAULT_REMEMBERED, DirectiveMemory
from leyline_agent.server.inputs import DEFAULT_MAX_MESSAGES, InputLimits, check_json_body
from leyline_agent.server.key_limits import KeyLimit, KeyLimits
from leyline_agent.server.leyline_routes import router as leyline_router
from leyline_agent.server.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit, longest_token_bytes
from leyline_agent.server.messages_routes import router as messages_router
from leyline_agent.server.observability import AccessLog
from leyline_agent.server.observability import router as metrics_router
from leyline_agent.server.openai_routes import router as openai_router
from leyline_agent.server.responses_items import router as responses_items_router
from leyline_agent.server.responses_routes import router as responses_router
from leyline_agent.server.responses_store import ResponseStore
from leyline_agent.server.schema_work import SchemaLimits
from leyline_agent.server.state import ServerState
from leyline_agent.server.tenants import ApiKeys, BearerAuth, HostAllowlist, session_header
from leyline_agent.server.worker import (
    DEFAULT_QUEUE_TIMEOUT_S,
    ServedEngine,
    Worker,
    concurrency_for,
)

__all__ = ["create_app", "model_limits"]


def model_limits(engine: ServedEngine) -> ModelLimits:
    """Vocabulary size, context length and the longest token's bytes (once, at start-up)."""
    config = getattr(getattr(engine, "model", None), "config", None)
    vocab = getattr(config, "vocab_size", None) or len(engine.tokenizer)
    context = getattr(config, "max_position_embeddings", None)
    return ModelLimits(
        vocab_size=int(vocab),
        max_context=int(context) if context else None,
        longest_token_bytes=longest_token_bytes(engine.tokenizer),
    )


def create_app(
    engine_or_worker: ServedEngine | Worker,
    *,
    served_model_name: str | None = None,
    aliases: Iterable[str] = (),
    default_max_tokens: int = CHAT_DEFAULT_MAX_TOKENS,
    api_keys: ApiKeys | Iterable[str | tuple[str, str | None]] = (),
    allowed_hosts: Iterable[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_prompt_tokens: int | None = None,
    max_tokens_cap: int | None = None,
    queue_timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S,
    remembered_request_ids: int = DEFAULT_REMEMBERED,
    client_edits: str = "off",
    concurrency: int | None = None,
    max_messages: int = DEFAULT_MAX_MESSAGES,
    schema_limits: SchemaLimits | None = None,
    key_limits: KeyLimits | None = None,
) -> FastAPI:
    """The app serving one engine.

    ``served_model_name`` defaults to the engine's name; ``default_max_tokens`` bounds a chat
    answer whose request sets no ``max_tokens``. ``api_keys``: keys (or ``(key, tenant)``
    pairs); none means no authentication and one tenant. ``allowed_hosts``: None turns the
    ``Host`` check off; a collection turns it on (loopback names plus these).
    ``max_prompt_tokens`` defaults to the model's context; ``max_tokens_cap`` to none.
    ``queue_timeout_s`` and ``concurrency`` (requests run at once; None: 16 for an engine
    that says it is ``thread_safe``, else 1) apply to the worker the app builds from an
    engine (a given ``Worker`` has its own).
    ``client_edits``: how chat requests' in-place edits of a conversation the server has
    cached are spliced (``amortize``, ``forget``, ``off``; ``chat_context``). ``off`` (the
    library default) is the plain prefix cache; ``leyline serve`` defaults to ``amortize``.
    ``schema_limits``: bounds on a request's tools and schemas (``schema_work``).
    ``max_messages``: a message list longer than this is refused before it is validated or
    rendered (``inputs``). ``key_limits``: requests and body bytes in flight per API key,
    past which a request gets 429 before its body is read (``key_limits``).
    """
    if client_edits not in CLIENT_EDIT_MODES:
        raise ValueError(f"client_edits: {client_edits!r} is not one of {CLIENT_EDIT_MODES}")
    if isinstance(engine_or_worker, Worker):
        if concurrency is not None:
            raise ValueError("concurrency: a given Worker keeps its own; set it on the Worker")
        worker, owned = engine_or_worker, False
    else:
        threads = concurrency_for(engine_or_worker, concurrency)
        worker = Worker(engine_or_worker, queue_timeout_s=queue_timeout_s, concurrency=threads)
        owned = True
    for name, value in (
        ("max_prompt_tokens", max_prompt_tokens),
        ("max_tokens_cap", max_tokens_cap),
        ("max_messages", max_messages),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{name}: {value} must be >= 1")
    keys = api_keys if isinstance(api_keys, ApiKeys) else ApiKeys.build(api_keys)
    engine = worker.engine
    engine_name = str(engine.model_name)
    limits = worker.call(model_limits)
    model = ServedModel(
        id=served_model_name or Path(engine_name).name or engine_name,
        aliases=frozenset({engine_name, *aliases}),
        created=int(time.time()),
        limits=limits,
        default_max_tokens=default_max_tokens,
        max_prompt_tokens=max_prompt_tokens or limits.max_context,
        max_tokens_cap=max_tokens_cap,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        app.state.leyline_responses.close()  # the store's files (responses_store)
        if owned:
            worker.close(cancel_pending=True)

    app = FastAPI(title="Leyline", version="0.1.0", lifespan=lifespan)
    app.state.leyline = ServerState(
        worker=worker,
        model=model,
        directive_memory=DirectiveMemory(remembered_request_ids),
        client_edits=client_edits,
        inputs=InputLimits(
            max_messages=max_messages,
            longest_token_bytes=limits.longest_token_bytes,
            max_prompt_tokens=model.max_prompt_tokens,
        ),
    )
    errors.install(app)
    checks = [Depends(check_json_body), Depends(session_header)]
    app.include_router(openai_router, dependencies=checks)
    app.include_router(responses_router, dependencies=checks)
    app.include_router(responses_items_router, dependencies=checks)
    app.include_router(messages_router, dependencies=checks)
    app.state.leyline_responses = ResponseStore()  # previous_response_id (responses_routes)
    app.state.leyline_schema_limits = schema_limits or SchemaLimits()  # schema_work
    app.include_router(leyline_router, dependencies=checks)
    app.include_router(metrics_router, dependencies=checks)  # /metrics (observability)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model.id}

    # add_middleware wraps what is there: the last added is the outermost.
    app.add_middleware(errors.ErrorGuard)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(KeyLimit, limits=key_limits or KeyLimits())  # inside BearerAuth
    if keys:
        app.add_middleware(BearerAuth, keys=keys)
        app.add_middleware(http_guards.AnthropicKeyHeader)  # x-api-key on /v1/messages
    if allowed_hosts is not None:
        app.add_middleware(HostAllowlist, names=list(allowed_hosts))
    app.add_middleware(AccessLog)  # outermost: every request gets an id and a log line
    return app
