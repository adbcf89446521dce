"""``create_app(engine_or_scheduler)``: the FastAPI application of ``leyline serve``.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (``openai_routes``),
``/leyline/v1/directives``, ``/leyline/v1/stats`` (``leyline_routes``), ``/health``.
Every engine call goes through one ``Scheduler``; an app built from an engine owns its
scheduler and closes it when the app shuts down.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from leyline_agent.server import errors
from leyline_agent.server.completions import CHAT_DEFAULT_MAX_TOKENS, ModelLimits, ServedModel
from leyline_agent.server.leyline_routes import router as leyline_router
from leyline_agent.server.openai_routes import router as openai_router
from leyline_agent.server.scheduler import Engine, Scheduler
from leyline_agent.server.state import ServerState

__all__ = ["create_app", "model_limits"]


def model_limits(engine: Engine) -> ModelLimits:
    """Vocabulary size and context length, from the model's config (or the tokenizer)."""
    config = getattr(getattr(engine, "model", None), "config", None)
    vocab = getattr(config, "vocab_size", None) or len(engine.tokenizer)
    context = getattr(config, "max_position_embeddings", None)
    return ModelLimits(vocab_size=int(vocab), max_context=int(context) if context else None)


def _default_params_cls() -> type:
    from leyline_agent.runtime.sampling import SamplingParams

    return SamplingParams


def create_app(
    engine_or_scheduler: Engine | Scheduler,
    *,
    served_model_name: str | None = None,
    aliases: Iterable[str] = (),
    params_cls: type | None = None,
    default_max_tokens: int = CHAT_DEFAULT_MAX_TOKENS,
) -> FastAPI:
    """The app serving one engine. ``served_model_name`` defaults to the engine's name;
    ``default_max_tokens`` bounds a chat answer whose request sets no ``max_tokens``."""
    if isinstance(engine_or_scheduler, Scheduler):
        scheduler, owned = engine_or_scheduler, False
    else:
        scheduler, owned = Scheduler(engine_or_scheduler), True
    engine = scheduler.engine
    engine_name = str(engine.model_name)
    model = ServedModel(
        id=served_model_name or Path(engine_name).name or engine_name,
        aliases=frozenset({engine_name, *aliases}),
        created=int(time.time()),
        limits=scheduler.call(model_limits),
        default_max_tokens=default_max_tokens,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if owned:
            scheduler.close(cancel_pending=True)

    app = FastAPI(title="Leyline", version="0.1.0", lifespan=lifespan)
    app.state.leyline = ServerState(
        scheduler=scheduler, model=model, params_cls=params_cls or _default_params_cls()
    )
    errors.install(app)
    app.include_router(openai_router)
    app.include_router(leyline_router)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model.id}

    return app
