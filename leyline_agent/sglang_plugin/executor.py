"""One directive request through SGLang: check -> prefill -> splice, or a counted fallback.

The loop is the same for the embedded ``sglang.Engine`` (``client.SGLangRuntime``) and for
SGLang's own HTTP server (``http_route.SGLangRoute``); only the transport differs. So it
exists once, here, over a ``Transport``:

- ``rpc(method, kwargs)``: a scheduler method on every TP rank (``leyline_check``,
  ``leyline_splice``, ``leyline_forget``); a failure comes back as the Leyline error it
  carried (``scheduler_hook.error_from_message``);
- ``prefill(token_ids, extra_key)``: a normal one-token request (SGLang's own prefill
  caches it) in the session's radix namespace.

For each ``batch.DirectiveCalls`` (right to left): the RPC before (read-only check, or the
FORGET's drop), the prefill, the RPC after (the AMORTIZE splice). A ``CacheMissError`` with
``fallback`` set is answered ``fallback=True`` (nothing executed). Every Leyline error is
counted in ``directive_errors``, every answer in the ``Counters`` (``/leyline/v1/stats``).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from leyline_agent.errors import CacheMissError, LeylineError
from leyline_agent.namespaces import named_namespace
from leyline_agent.sglang_plugin.batch import compile_request, plan_calls, response_for
from leyline_agent.wire import Counters, DirectivesRequest, DirectivesResponse

__all__ = ["DirectiveExecutor", "Transport"]


class Transport(Protocol):
    tokenizer: Any
    model_type: str | None

    async def rpc(self, method: str, kwargs: dict[str, Any]) -> None: ...

    async def prefill(self, token_ids: list[int], extra_key: str) -> None: ...


class DirectiveExecutor:
    """Runs directive requests over one transport, one at a time (the caller serializes)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.counters = Counters()

    async def execute(
        self, req: DirectivesRequest, session_header: str | None = None
    ) -> DirectivesResponse:
        t0 = time.perf_counter()
        try:
            resp = await self._execute(req, session_header)
        except LeylineError:
            self.counters.directive_errors += 1
            raise
        resp = resp.model_copy(update={"elapsed_s": time.perf_counter() - t0})
        self.counters.count_directive(resp)
        # the directive's prefills are SGLang requests this plugin made: its own to count
        self.counters.prefilled_tokens += resp.prefilled_tokens
        return resp

    async def _execute(
        self, req: DirectivesRequest, session_header: str | None
    ) -> DirectivesResponse:
        tr = self.transport
        key = named_namespace(req.session, session_header).key
        tokens, directives = compile_request(req, tr.tokenizer, tr.model_type)
        calls = plan_calls(tokens, directives, key)
        try:
            for c in calls:
                await tr.rpc(c.rpc_before, c.rpc_kwargs)  # check / forget: before any prefill
                await tr.prefill(c.prefill_ids, key)
                if c.rpc_after is not None:
                    await tr.rpc(c.rpc_after, c.rpc_kwargs)
        except CacheMissError:
            if not req.fallback:
                raise
            return response_for(calls, tokens, fallback=True)
        return response_for(calls, tokens)
