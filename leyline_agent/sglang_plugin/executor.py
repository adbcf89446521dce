"""One directive request through SGLang: compile, look up, decide, then check -> prefill ->
splice.

The loop is the same for the embedded ``sglang.Engine`` (``client.SGLangRuntime``) and for
SGLang's own HTTP server (``http_route.SGLangRoute``); only the transport differs. So it
exists once, here, over a ``Transport``:

- ``rpc(method, kwargs)``: a scheduler method on every TP rank (``leyline_lookup``,
  ``leyline_check``, ``leyline_splice``, ``leyline_forget``); its answer (``leyline_lookup``'s
  JSON, else empty), or the Leyline error its failure carried
  (``scheduler_hook.answer_of``);
- ``prefill(token_ids, extra_key)``: a normal one-token request (SGLang's own prefill
  caches it) in the session's radix namespace.

The request goes through ``directives.pipeline`` as on every backend: compiled, the cached
length of its base asked of the scheduler (``cached_prefix``: ``leyline_lookup``, a
``directives.backend.PrefixLookup``), decided: a miss (``CacheMissError``, or the
``fallback`` answer), a noop, or a plan. For each of the plan's ``batch.DirectiveCalls``
(right to left): the RPC before (read-only check, or the FORGET's drop), the prefill, the
RPC after (the AMORTIZE splice). Nothing holds the base between two calls: a
``CacheMissError`` of a check (the rows were evicted since the lookup) is raised, or with
``fallback`` answered as a miss is (directives to its right may have been spliced already;
what they cached is the session's, the next request prefills the rest). Every Leyline error is counted in ``directive_errors``, every answer in the
``Counters`` (``/leyline/v1/stats``).
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from leyline_agent.directives.pipeline import compile_request, decide, fallback_answer
from leyline_agent.errors import CacheMissError, LeylineError, RuntimeUnavailableError
from leyline_agent.families import chat_format, token_id
from leyline_agent.namespaces import named_namespace
from leyline_agent.sglang_plugin.batch import EXECUTES, plan_calls, response_for
from leyline_agent.sglang_plugin.scheduler_hook import RPC_LOOKUP, encode_lookup_kwargs
from leyline_agent.wire import Counters, DirectivesRequest, DirectivesResponse

__all__ = ["DirectiveExecutor", "Transport"]


class Transport(Protocol):
    tokenizer: Any
    model_type: str | None
    vocab_size: int

    async def rpc(self, method: str, kwargs: dict[str, Any]) -> str: ...

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

    async def cached_prefix(self, tokens: list[int], namespace: str) -> int:
        """``directives.backend.PrefixLookup``: how much of ``tokens`` a directive of the
        radix namespace ``namespace`` finds cached (``scheduler_hook.leyline_lookup``)."""
        answer = await self.transport.rpc(RPC_LOOKUP, encode_lookup_kwargs(tokens, namespace))
        if not answer:
            raise RuntimeUnavailableError(
                f"{RPC_LOOKUP} came back without its answer: the plugin's hook on "
                "Scheduler.handle_rpc_request is not applied in the scheduler"
            )
        return int(json.loads(answer)["cached_tokens"])

    async def _execute(
        self, req: DirectivesRequest, session_header: str | None
    ) -> DirectivesResponse:
        tr = self.transport
        key = named_namespace(req.session, session_header).key
        boundary = token_id(tr.tokenizer, chat_format(tr.model_type).message_boundary)
        compiled = compile_request(req, tr.tokenizer, tr.vocab_size, boundary, EXECUTES)
        cached = await self.cached_prefix(compiled.base, key) if compiled.needs_lookup else 0
        plan = decide(compiled, cached, req)
        if isinstance(plan, DirectivesResponse):
            return plan
        calls = plan_calls(plan.base, plan.order, key)
        try:
            for c in calls:
                await tr.rpc(c.rpc_before, c.rpc_kwargs)  # check / forget: before any prefill
                await tr.prefill(c.prefill_ids, key)
                if c.rpc_after is not None:
                    await tr.rpc(c.rpc_after, c.rpc_kwargs)
        except CacheMissError:
            if not req.fallback:
                raise
            return fallback_answer(compiled)
        return response_for(calls, plan)
