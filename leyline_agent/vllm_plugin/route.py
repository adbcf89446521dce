"""API server side: ``POST /leyline/v1/directives``, ``GET /leyline/v1/stats``,
``POST /leyline/v1/flush``, as a ``vllm.endpoint_plugins`` plugin.

A directive goes through ``directives.service.DirectiveService`` over the shared backend of an
engine in another process (``directives.remote_engine.RemoteEngineBackend``: hold, execute,
release, count, flush, stats). ``VLLMRoute`` is that backend on vLLM's engine client, whose
``EngineTransport`` (``VLLMEngine``) is vLLM's own calls:

- an op: the utility call ``leyline_rpc`` (``engine_ops``), run in the EngineCore's busy
  loop between two steps;
- a head ``T[:s] + R`` or a FORGET's ``T'``: an ordinary vLLM request (one greedy token)
  through ``engine_client.generate`` under the namespace's ``cache_salt``
  (``namespace.salt_for``); a head's blocks are held when it finishes
  (``scheduler.HOLD_KEY``), rows past its last full block too (``held_rows``,
  ``connector``);
- the renderer: vLLM's own (what its ``/tokenize`` runs), so the chat front splices the
  very tokens vLLM will prefill.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from leyline_agent.directives.answers import error_content
from leyline_agent.directives.modes import executed_by
from leyline_agent.directives.remote_engine import RemoteEngineBackend
from leyline_agent.errors import RequestError, RuntimeUnavailableError
from leyline_agent.front.conversations import ConversationStore
from leyline_agent.front.door import BODY_KEY
from leyline_agent.http.directive_routes import add_directive_routes
from leyline_agent.namespaces import Namespace
from leyline_agent.vllm_plugin.namespace import salt_for
from leyline_agent.vllm_plugin.scheduler import HOLD_KEY

if TYPE_CHECKING:
    from starlette.datastructures import State
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["EXECUTES", "VLLMEngine", "VLLMRoute", "add_routes"]

# REPAIR runs as AMORTIZE, then the workers recompute its selected tail rows in place
# (``row_forward``); a model whose layers the row forward does not know is refused (503).
ROW_OPS = frozenset({"move", "prefill", "recompute"})
EXECUTES = executed_by(ROW_OPS)


class VLLMEngine:
    """``remote_engine.EngineTransport`` over vLLM's engine client (module doc);
    ``app_state``: the app's, for vLLM's renderer (None: the tokenizer renders)."""

    def __init__(self, engine_client: AsyncLLM, model_name: str, app_state: State | None) -> None:
        self.engine = engine_client
        self.model_name = model_name
        self.app_state = app_state

    def salt_for(self, ns: Namespace) -> str:
        return salt_for(ns)

    async def call(self, request_json: str) -> str:
        return await self.engine.engine_core.call_utility_async("leyline_rpc", request_json)

    async def prefill(self, ids: list[int], salt: str, hold_id: str | None) -> None:
        from vllm.sampling_params import SamplingParams

        params = SamplingParams(
            max_tokens=1, temperature=0.0, extra_args={HOLD_KEY: hold_id} if hold_id else None
        )
        prompt = {"prompt_token_ids": list(ids), "cache_salt": salt}
        rid = f"leyline-{'head' if hold_id else 'forget'}-{uuid.uuid4().hex}"
        async for _ in self.engine.generate(prompt, params, rid):
            pass

    def tokenizer(self) -> TokenizerLike:
        return self.engine.get_tokenizer()

    async def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any]
    ) -> list[int] | None:
        """vLLM's renderer (``app_state.serving_tokenization``; None if the app has none)."""
        serving = getattr(self.app_state, "serving_tokenization", None)
        if serving is None:
            return None
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

        body = {"model": self.model_name, "messages": messages, "tools": tools, **kwargs}
        try:
            req = TokenizeChatRequest.model_validate(body)
        except ValueError as e:
            raise RequestError(f"vLLM cannot render these messages: {e}", "messages") from e
        out = await serving.create_tokenize(req, None)
        tokens = getattr(out, "tokens", None)
        if tokens is None:  # vLLM's ErrorResponse
            raise RequestError(f"vLLM cannot render these messages: {out}", "messages")
        return list(tokens)


class VLLMRoute(RemoteEngineBackend[ConversationStore]):
    """The plugin's app state (``app.state.leyline``): the shared backend on ``VLLMEngine``,
    with the chat front's conversations (``front.chat_proxy``)."""

    def __init__(
        self, engine_client: AsyncLLM, model_names: list[str], app_state: State | None = None
    ) -> None:
        engine = VLLMEngine(engine_client, model_names[0], app_state)
        super().__init__(engine, model_names, ConversationStore(), EXECUTES)


def add_routes(app: FastAPI) -> None:
    """``/leyline/v1/directives``, ``/leyline/v1/stats``, ``/leyline/v1/flush``
    (``http.directive_routes``) over the app's ``VLLMRoute``. Their key check, body cap and
    JSON checks are ``front.door.FrontDoor``'s (in front of every route, leaving the body
    under ``BODY_KEY``); a route reached without it (a test app) reads its body with the
    same checks."""

    def route_of(request: Request) -> VLLMRoute:
        route = getattr(request.app.state, "leyline", None)
        if route is None:
            raise RuntimeUnavailableError("the Leyline route has no engine")
        return route

    add_directive_routes(app, lambda r: route_of(r).mount, error_content, body_key=BODY_KEY)
