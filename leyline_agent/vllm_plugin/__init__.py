"""Leyline as a vLLM 0.32 plugin: AMORTIZE splices inside vLLM's own prefix cache.

Three levels, as vLLM has them: the ``BlockPool`` (block hash -> ``KVCacheBlock``, full
blocks only, hashes chained over the tokens and the request's ``cache_salt``), the
scheduler that hands blocks to requests, and the workers' KV tensors.

- ``namespace``: which salt a request is served under (spliced blocks live in their
  session's namespace; unsalted blocks are exact prefills only).
- ``route``: the directive routes over the shared backend of an engine in another process
  (``directives.remote_engine``), on vLLM's transport: ``directives.engine_rpc``'s ops to
  the EngineCore, vLLM's own requests for the prefills.
- ``scheduler``: ``LeylineScheduler`` (routing, holding a directive's head, counters, pins).
- ``connector``: rows past a sequence's last full block (``directives.held_rows``), handed
  to the next request as computed tokens through vLLM's KV connector API.
- ``engine_ops``: ``EngineCore.leyline_rpc``, the ops that run between two engine steps.
- ``worker`` / ``row_forward``: ``LeylineWorkerExtension`` (rows copied, keys rotated and
  rows computed in place, with ``kernels.paged_rows``), ``layer_rows`` / ``cache_layout``:
  each backend's cache layout, probed with its own write op.
- ``guard``: what Leyline's front door (``front.door``: keys, chat and Messages fronts,
  sessions; ``front.pin_report``) reads of vLLM's app.

Entry points (``pyproject.toml``): ``vllm.general_plugins: leyline = register`` (loaded by
vLLM in the API server, the EngineCore and the workers) and ``vllm.endpoint_plugins:
leyline = LeylineEndpoints`` (the routes). Both are opt-in: vLLM loads an endpoint plugin
only when ``VLLM_PLUGINS`` names it, and ``register`` does nothing unless it does::

    VLLM_PLUGINS=leyline vllm serve MODEL --enable-prefix-caching

With ``VLLM_PLUGINS`` naming ``leyline``, ``register`` makes the engine's defaults the
plugin's scheduler, worker extension and KV connector (``connector``: rows past a
sequence's last full block handed to the next request); a ``--scheduler-cls`` /
``--worker-extension-cls`` given explicitly is kept and the routes then refuse, naming it;
a ``--kv-transfer-config`` of your own is kept and splices then hold whole blocks only
(the directive's ``rotated_tokens`` and the next request's ``cached_tokens`` say how many
rows were kept).
Importing this package imports neither torch nor vLLM.
"""

from __future__ import annotations

import os
from argparse import Namespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.datastructures import State
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.protocol import EngineClient

__all__ = [
    "CONNECTOR_CLS",
    "SCHEDULER_CLS",
    "WORKER_EXTENSION_CLS",
    "LeylineEndpoints",
    "enabled",
    "register",
]

PLUGIN_NAME = "leyline"
SCHEDULER_CLS = "leyline_agent.vllm_plugin.scheduler.LeylineScheduler"
WORKER_EXTENSION_CLS = "leyline_agent.vllm_plugin.worker.LeylineWorkerExtension"
CONNECTOR_CLS = "leyline_agent.vllm_plugin.connector.LeylineConnector"


def enabled() -> bool:
    """``VLLM_PLUGINS`` names this plugin (vLLM's allow-list, comma-separated)."""
    names = os.environ.get("VLLM_PLUGINS")
    return names is not None and PLUGIN_NAME in [n.strip() for n in names.split(",")]


def register() -> None:
    """Entry point of ``vllm.general_plugins``; idempotent (vLLM may call it per process)."""
    if not enabled():
        return
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCore

    from leyline_agent.vllm_plugin.engine_ops import leyline_rpc

    if getattr(EngineCore, "leyline_rpc", None) is not leyline_rpc:
        EngineCore.leyline_rpc = leyline_rpc  # a new utility method; nothing of vLLM's changes
    create = EngineArgs.create_engine_config
    if not getattr(create, "_leyline", False):

        def create_engine_config(self: EngineArgs, *args: object, **kwargs: object) -> VllmConfig:
            if self.scheduler_cls is None:
                self.scheduler_cls = SCHEDULER_CLS
            if not self.worker_extension_cls:
                self.worker_extension_cls = WORKER_EXTENSION_CLS
            if self.kv_transfer_config is None:
                from vllm.config import KVTransferConfig

                self.kv_transfer_config = KVTransferConfig(
                    kv_connector=CONNECTOR_CLS.rsplit(".", 1)[1],
                    kv_connector_module_path=CONNECTOR_CLS.rsplit(".", 1)[0],
                    kv_role="kv_consumer",  # it only loads rows; nothing is handed off
                )
            return create(self, *args, **kwargs)  # type: ignore[arg-type]

        create_engine_config._leyline = True  # type: ignore[attr-defined]
        EngineArgs.create_engine_config = create_engine_config


class LeylineEndpoints:
    """The ``vllm.endpoint_plugins`` factory: routes, the guard middleware, their state."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        from leyline_agent.front.door import FrontDoor
        from leyline_agent.front.pin_report import PinReport
        from leyline_agent.http import guards as http_guards
        from leyline_agent.vllm_plugin.guard import VLLM
        from leyline_agent.vllm_plugin.route import add_routes

        add_routes(app)
        app.add_middleware(PinReport, VLLM)  # inside the door: it sees the body the door hands on
        app.add_middleware(FrontDoor, VLLM)
        # vLLM adds its key check after the plugins' middleware, so outside it; the
        # Anthropic SDK's x-api-key must be read before that check: outermost, when the
        # stack is built (at the first request)
        build = app.build_middleware_stack
        app.build_middleware_stack = lambda: http_guards.AnthropicKeyHeader(build())

    async def init_state(
        self, engine_client: EngineClient | None, state: State, args: Namespace
    ) -> None:
        import structlog

        from leyline_agent.front.chat_proxy import ChatFront
        from leyline_agent.vllm_plugin.guard import FRONT_STATE, KEYS_STATE, api_keys
        from leyline_agent.vllm_plugin.route import VLLMRoute

        setattr(state, KEYS_STATE, api_keys(args))  # the guard's key check, vLLM's keys
        if engine_client is None:
            return
        names = list(getattr(args, "served_model_name", None) or []) or [str(args.model)]
        route = VLLMRoute(engine_client, names, state)  # state: vLLM's renderer, for the chat
        state.leyline = route
        setattr(state, FRONT_STATE, ChatFront(route))  # leyline.edits of chat requests
        info = await route.info()
        log = structlog.get_logger(__name__)
        if info.problem:
            log.warning("leyline directives off", problem=info.problem)
        else:
            log.info("leyline directives on", block_size=info.block_size, tp=info.tp)
            if not info.held_rows:
                log.warning(
                    "leyline keeps whole blocks only: kv_transfer_config names another "
                    "connector, so rows past a sequence's last full block are prefilled again "
                    "by the next request (rotated_tokens and cached_tokens say how many were kept)"
                )
