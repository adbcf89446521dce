"""``POST /leyline/v1/directives``, ``GET /leyline/v1/stats`` and ``POST /leyline/v1/flush``
on SGLang's HTTP server.

The plugin framework can hook any function: a ``BEFORE`` hook on
``http_server._setup_and_run_http_server`` (called once in the main process, before
uvicorn starts) adds the routes to SGLang's FastAPI ``app``. A flush frees every cached row no request
holds (SGLang serves one tenant, ``""``; ``scheduler_hook.leyline_flush``). The route speaks the same
wire models as ``leyline serve`` (``leyline_agent.wire``), so the agent-side
``HTTPRuntime`` works against either server.

The routes are ``http.directive_routes``'s, as on vLLM: the body is read and checked as
every Leyline front checks it (``http.guards.read_json``: 413 past
``LEYLINE_MAX_BODY_BYTES``, default 16 MiB; not JSON, too deep, a lone surrogate or a
non-finite number: 400 naming the field). The request goes through
``directives.service.DirectiveService`` (parse, model and limits,
``request_id``, per-namespace order, compile, decide, counters, error bodies), as on
``leyline serve``; its backend (``executor.SGLangBackend``) sends
``RpcReqInput("leyline_lookup")`` (how much of the base is cached; the answer rides back in
the reply's message), every ``RpcReqInput("leyline_check")`` of the plan (read-only), then
per directive (``batch.plan_calls``) the head through the server's own
``TokenizerManager.generate_request`` (SGLang's prefill, caching it) and
``RpcReqInput("leyline_splice")``; a FORGET is ``RpcReqInput("leyline_forget")`` then a
request for ``T'``. The RPCs go to scheduler rank 0
over the RPC socket SGLang created for ``Engine.collective_rpc`` (``port_args.rpc_ipc_name``;
in HTTP-server mode no ``Engine`` binds it, so the route does) and are broadcast to every TP
rank. Single tokenizer worker only
(``--tokenizer-worker-num 1``).

Sessions: the ``X-Leyline-Session`` header or the body's ``session`` names the namespace
(both: they must agree; neither: the anonymous session). Every call of the directive
carries its key (``routing.py``); the client's own generation requests get it from the
same header, mapped by ``routing.before_generate_request``.
"""

from __future__ import annotations

from typing import Any

import structlog

from leyline_agent.directives.answers import error_content
from leyline_agent.directives.service import DirectiveService, PluginMount
from leyline_agent.http.directive_routes import add_directive_routes
from leyline_agent.sglang_plugin.batch import PREFILL_PARAMS
from leyline_agent.sglang_plugin.client import directive_service
from leyline_agent.sglang_plugin.executor import SGLangBackend
from leyline_agent.sglang_plugin.scheduler_hook import answer_of
from leyline_agent.wire import Counters

__all__ = ["SGLangRoute", "before_http_server"]

log = structlog.get_logger(__name__)


class SGLangRoute:
    """The backend's transport on SGLang's HTTP server: requests through the server's own
    ``TokenizerManager``, RPCs over the scheduler's RPC socket; the directive service in
    front (one directive of a namespace at a time)."""

    def __init__(self, tokenizer_manager: Any, rpc_ipc_name: str) -> None:
        self.tm = tokenizer_manager
        self.rpc_ipc_name = rpc_ipc_name
        self.backend = SGLangBackend(self)
        self.service: DirectiveService = directive_service(tokenizer_manager)
        self._sock: Any = None
        self.mount = PluginMount(self.backend, self._service, self.stats)  # the routes' answers

    async def _service(self) -> DirectiveService:
        return self.service

    @property
    def counters(self) -> Counters:
        return self.backend.counters

    async def stats(self) -> dict[str, Any]:
        """``GET /leyline/v1/stats``: the backend's counters."""
        return self.counters.to_stats().model_dump(mode="json")

    async def prefill(self, token_ids: list[int], extra_key: str) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=list(token_ids), sampling_params=dict(PREFILL_PARAMS), extra_key=extra_key
        )
        await self.tm.generate_request(obj, None).__anext__()

    async def rpc(self, method: str, kwargs: dict[str, Any]) -> str:
        """``method`` on every scheduler rank: its answer, or the error it carried."""
        from sglang.srt.managers.io_struct import RpcReqInput

        return answer_of(
            await self.round_trip(RpcReqInput(method=method, parameters=kwargs)), method
        )

    async def round_trip(self, req: Any) -> Any:
        """One ``RpcReqInput`` to scheduler rank 0 over the RPC socket; its ``RpcReqOutput``."""
        from sglang.srt.managers.io_struct import async_sock_recv, async_sock_send

        if self._sock is None:
            import zmq
            import zmq.asyncio
            from sglang.srt.utils.network import get_zmq_socket

            self._sock = get_zmq_socket(zmq.asyncio.Context(1), zmq.DEALER, self.rpc_ipc_name, True)
        await async_sock_send(self._sock, req)
        return await async_sock_recv(self._sock)


def add_routes(app: Any, route: SGLangRoute) -> None:
    """The three Leyline routes (``http.directive_routes``) over ``route``."""
    add_directive_routes(app, lambda request: route.mount, error_content)


def before_http_server(server_args: Any, tokenizer_manager: Any, template_manager: Any,
                       port_args: Any, *args: Any, **kwargs: Any) -> None:  # fmt: skip
    """``HookType.BEFORE`` on ``_setup_and_run_http_server``: add the routes; args unchanged."""
    from sglang.srt.entrypoints.http_server import app

    if tokenizer_manager is None:
        log.warning("leyline routes not added: no tokenizer manager in this process")
        return None
    add_routes(app, SGLangRoute(tokenizer_manager, port_args.rpc_ipc_name))
    return None
