"""SGLang as a ``directives.service.DirectiveBackend``: look up, check all, then prefill ->
splice, over a transport.

The same for the embedded ``sglang.Engine`` (``client.SGLangRuntime``) and for SGLang's own
HTTP server (``http_route.SGLangRoute``); only the transport differs:

- ``rpc(method, kwargs)``: a scheduler method on every TP rank (``leyline_lookup``,
  ``leyline_check``, ``leyline_splice``, ``leyline_forget``); its answer (``leyline_lookup``'s
  JSON, else empty), or the Leyline error its failure carried
  (``scheduler_hook.answer_of``);
- ``prefill(token_ids, extra_key)``: a normal one-token request (SGLang's own prefill
  caches it) in the session's radix namespace.

Everything else (parse, limits, ``request_id``, compile, decide, counting) is the
``DirectiveService``'s. ``hold`` asks ``leyline_lookup`` how much of the base the
namespace finds cached; SGLang's scheduler keeps no lock between two RPCs, so nothing is
held: ``execute`` first sends the read-only ``leyline_check`` of every AMORTIZE directive of
the plan (a directive's base ``T[:end]`` is the same before and after the directives to its
right), then runs the ``batch.DirectiveCalls`` right to left: the RPC before (the check
again, or the FORGET's drop), the prefill, the RPC after (the splice). A batch whose rows
are gone at the first check changes nothing; rows evicted between two calls of a running
batch fail it with ``CacheMissError`` (409), the directives to its right staying spliced
in the session's namespace.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from leyline_agent.directives.core import Mode
from leyline_agent.directives.modes import executed_by
from leyline_agent.directives.pipeline import Plan
from leyline_agent.directives.service import Flushed
from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.namespaces import Namespace
from leyline_agent.sglang_plugin.batch import ROW_OPS, plan_calls, response_for
from leyline_agent.sglang_plugin.scheduler_hook import (
    RPC_CHECK,
    RPC_FLUSH,
    RPC_LOOKUP,
    encode_lookup_kwargs,
)
from leyline_agent.wire import Counters, DirectivesResponse

__all__ = ["CachedBase", "SGLangBackend", "Transport"]


class Transport(Protocol):
    async def rpc(self, method: str, kwargs: dict[str, Any]) -> str: ...

    async def prefill(self, token_ids: list[int], extra_key: str) -> None: ...


@dataclass(frozen=True, slots=True)
class CachedBase:
    """``leyline_lookup``'s answer: the first ``length`` tokens of the base are cached."""

    length: int


class SGLangBackend:
    """``DirectiveBackend`` over one transport (module doc); one ``Counters`` for the server."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.counters = Counters()

    @property
    def executes(self) -> frozenset[Mode]:
        return executed_by(ROW_OPS)

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

    async def hold(self, base: list[int], ns: Namespace) -> CachedBase:
        return CachedBase(await self.cached_prefix(base, ns.key))

    async def execute(self, plan: Plan, held: CachedBase, ns: Namespace) -> DirectivesResponse:
        tr = self.transport
        calls = plan_calls(plan.base, plan.order, ns.key)
        for c in calls:  # check all: read-only, before the first write
            if c.rpc_before == RPC_CHECK:
                await tr.rpc(RPC_CHECK, c.rpc_kwargs)
        for c in calls:  # then mutate, right to left
            await tr.rpc(c.rpc_before, c.rpc_kwargs)  # check again / forget: before the prefill
            await tr.prefill(c.prefill_ids, ns.key)
            if c.rpc_after is not None:
                await tr.rpc(c.rpc_after, c.rpc_kwargs)
        resp = response_for(calls, plan)
        # the directive's prefills are SGLang requests this plugin made: its own to count
        self.counters.prefilled_tokens += resp.prefilled_tokens
        return resp

    async def release(
        self, held: CachedBase, ns: Namespace, answer: DirectivesResponse | None
    ) -> None:
        return None  # nothing was held (module doc)

    async def count(self, ns: Namespace, update: Callable[[Counters], None]) -> None:
        update(self.counters)

    async def flush(self, tenant: str) -> Flushed:
        """Every row no request holds, of every namespace: SGLang serves one tenant."""
        answer = await self.transport.rpc(RPC_FLUSH, {})
        if not answer:
            raise RuntimeUnavailableError(f"{RPC_FLUSH} came back without its answer")
        got = json.loads(answer)
        return Flushed(int(got["flushed_tokens"]), int(got["kept_tokens"]))
