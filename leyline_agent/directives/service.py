"""``POST /leyline/v1/directives`` as one service, the same on every engine (torch-free).

A server mounts one ``DirectiveService`` and hands each request's body to it; the engine
behind it is a ``DirectiveBackend``: look up and hold the cached prefix of a base, execute
a plan on it, release it, and count. Everything else is the service's, in this order:

1. parse the body (``validate.parse_directives``: pydantic's errors, a 400 naming the
   field);
2. namespace: the caller's tenant and the session of the header or the body (the
   transport's ``namespace_of``);
3. ``request_id``: 1 to 256 printable characters (``idempotence.check_request_id``);
4. model and limits: the model name (404), the vocabulary, the prompt and replacement
   sizes, message shapes (``validate.checked``);
5. per-namespace ordering: a namespace's directives run one at a time, in arrival order
   (``ordered``; ``leyline serve`` orders them on its worker by the namespace instead);
6. idempotence: a ``request_id`` already answered in this namespace gets its first answer
   (another body under it: 400 naming ``request_id``); nothing runs again;
7. ``pipeline.compile_request`` with the modes the backend executes (a mode it does not:
   400 naming the field, before the cache is asked anything);
8. lookup: the backend holds the cached prefix of the base in the namespace;
9. ``pipeline.decide``: a miss (409, or the ``fallback`` answer), a noop, or a ``Plan``;
10. execute: the backend checks the whole plan, then mutates (a refused directive of a
    batch leaves the cache as it was); a miss only the backend can see (``executed``) is
    answered as ``decide``'s are; the held prefix is released whatever happened;
11. counters: every answer (``Counters.count_directive``); ``directive_errors`` counts the
    requests refused after they reached the cache (a miss, a failed execution): a bad body
    never reaches it and changes no counter;
12. error mapping: a ``LeylineError`` or an invalid body becomes the OpenAI-shaped error
    body with the field (``answers.error_content``): the plugins' routes
    (``http.directive_routes``) and ``leyline serve``'s handlers map what the service raises.

Steps 1-4 are ``admit`` (pure), 6-11 ``run``. ``flush`` empties a tenant's part of the
cache through the backend (``POST /leyline/v1/flush``). A plugin (vLLM, SGLang) mounts the
service on ``http.directive_routes`` through ``PluginMount``. ``run`` is a coroutine; a backend that never
suspends (the embedded engine, on its worker thread) is driven to its end by ``run_inline``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from leyline_agent.directives.core import Mode
from leyline_agent.directives.flush import FlushResponse
from leyline_agent.directives.idempotence import RequestMemory, check_request_id, fingerprint
from leyline_agent.directives.pipeline import (
    Compiled,
    Plan,
    compile_request,
    decide,
    fallback_answer,
)
from leyline_agent.directives.validate import (
    RequestLimits,
    check_served,
    checked,
    parse_directives,
)
from leyline_agent.errors import CacheMissError, LeylineError
from leyline_agent.namespaces import DEFAULT_TENANT, Namespace, named_namespace
from leyline_agent.wire import Counters, DirectivesRequest, DirectivesResponse

__all__ = [
    "DirectiveBackend",
    "DirectiveService",
    "Flushed",
    "FlushedRows",
    "HeldPrefix",
    "PluginMount",
    "ServedModel",
    "run_directive",
    "run_inline",
]


class HeldPrefix(Protocol):
    """A lookup's result: the leading ``length`` tokens of the base are cached, and held."""

    @property
    def length(self) -> int: ...


H = TypeVar("H", bound=HeldPrefix)


class DirectiveBackend(Protocol[H]):
    """What one engine gives the service (module doc, steps 8, 10 and 11)."""

    @property
    def executes(self) -> frozenset[Mode]:
        """The modes whose row operations this backend implements (``modes.executed_by``)."""
        ...

    async def hold(self, base: list[int], ns: Namespace) -> H:
        """The cached prefix of ``base`` in ``ns``, held until ``release`` (no eviction)."""
        ...

    async def execute(self, plan: Plan, held: H, ns: Namespace) -> DirectivesResponse:
        """Run ``plan`` on ``held``: every check of the batch before its first write; a
        failure leaves the cache as it was. The answer (``pipeline.applied_answer``)."""
        ...

    async def release(self, held: H, ns: Namespace, answer: DirectivesResponse | None) -> None:
        """Let ``held`` go (``answer``: what was answered; None after a failure)."""
        ...

    async def count(self, ns: Namespace, update: Callable[[Counters], None]) -> None:
        """Apply ``update`` to the counters ``ns``'s tenant's stats read."""
        ...

    async def flush(self, tenant: str) -> FlushedRows:
        """Free every cached row of ``tenant`` that no request in flight holds, and its
        pins; counters untouched."""
        ...


class FlushedRows(Protocol):
    """What a backend's flush did: rows freed, the tenant's rows still held, pins dropped."""

    @property
    def flushed_tokens(self) -> int: ...

    @property
    def kept_tokens(self) -> int: ...

    @property
    def dropped_pins(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Flushed:
    """A backend's ``FlushedRows`` as plain numbers (an engine that keeps no pins: 0)."""

    flushed_tokens: int
    kept_tokens: int
    dropped_pins: int = 0


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the service knows of the model before any request."""

    name: str
    tokenizer: Any
    limits: RequestLimits
    message_boundary_id: int | None
    aliases: tuple[str, ...] = ()


@dataclass(slots=True)
class DirectiveService:
    """One front door for directives (module doc); one per server."""

    model: ServedModel
    memory: RequestMemory[DirectivesResponse] = field(default_factory=RequestMemory)
    _locks: dict[str, list[Any]] = field(default_factory=dict)  # ns key -> [lock, holders]

    # -- the public API ------------------------------------------------------------------
    def admit(
        self, body: object, namespace_of: Callable[[str | None], Namespace]
    ) -> tuple[DirectivesRequest, Namespace]:
        """Steps 1-4: the checked request (its ``session`` set to the namespace's) and its
        namespace; raises pydantic's ``ValidationError`` or a ``LeylineError``."""
        req = parse_directives(body)
        ns = namespace_of(req.session)
        check_request_id(req.request_id)
        check_served(req.model, self.model.name, self.model.aliases)
        ready = checked(req, self.model.limits).model_copy(update={"session": ns.session})
        return ready, ns

    @asynccontextmanager
    async def ordered(self, ns: Namespace) -> AsyncIterator[None]:
        """Step 5 on the event loop: one directive of ``ns`` at a time, in arrival order."""
        entry = self._locks.setdefault(ns.key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[ns.key]

    async def run(
        self, req: DirectivesRequest, ns: Namespace, backend: DirectiveBackend[Any]
    ) -> DirectivesResponse:
        """Steps 6-11 for an admitted request; the caller orders ``ns``'s directives."""
        digest = fingerprint(req) if req.request_id is not None else ""
        first = self.memory.lookup(ns.key, req.request_id, digest)
        if first is not None:
            return first
        answer = await self._execute(req, ns, backend)
        self.memory.remember(ns.key, req.request_id, digest, answer)
        return answer

    async def run_made(
        self, req: DirectivesRequest, ns: Namespace, backend: DirectiveBackend[Any]
    ) -> DirectivesResponse:
        """A request the server made itself in ``ns`` (a chat turn's edits): checked against
        the limits (step 4), then run in ``ns``'s order (steps 5-11)."""
        ready = checked(req, self.model.limits)
        async with self.ordered(ns):
            return await self.run(ready, ns, backend)

    async def flush(self, tenant: str, backend: DirectiveBackend[Any]) -> FlushResponse:
        """``POST /leyline/v1/flush``'s cache part (``directives.flush``): the server adds
        what else it drops of the tenant (conversations, stored responses)."""
        rows = await backend.flush(tenant)
        return FlushResponse(
            tenant=tenant,
            flushed_tokens=rows.flushed_tokens,
            kept_tokens=rows.kept_tokens,
            dropped_pins=rows.dropped_pins,
            dropped_conversations=0,
        )

    # -- helpers -------------------------------------------------------------------------
    async def _execute(
        self, req: DirectivesRequest, ns: Namespace, backend: DirectiveBackend[Any]
    ) -> DirectivesResponse:
        m = self.model
        return await run_directive(
            req, ns, backend, m.tokenizer, m.limits.vocab_size, m.message_boundary_id
        )


class Conversations(Protocol):
    """A chat front's conversations (``front.conversations.ConversationStore``), as far as
    the directive routes touch them."""

    def directive_ran(self, ns: Namespace, req: DirectivesRequest) -> None: ...

    def forget_tenant(self, tenant: str) -> int: ...


class PluginMount:
    """What a plugin server answers its Leyline routes with (``http.directive_routes``'s
    ``DirectiveMount``): its one tenant's directives through the service (``service_of``:
    made on first use) over ``backend``, flushes, and ``stats_of``'s stats. A chat front's
    ``conversations`` are told what each directive ran and are dropped by a flush. Errors
    are raised, for the routes to answer."""

    def __init__(
        self,
        backend: DirectiveBackend[Any],
        service_of: Callable[[], Awaitable[DirectiveService]],
        stats_of: Callable[[], Awaitable[dict[str, Any]]],
        conversations: Conversations | None = None,
    ) -> None:
        self.backend = backend
        self.service_of = service_of
        self.stats = stats_of
        self.conversations = conversations

    async def directives(self, body: object, session_header: str | None) -> tuple[int, dict]:
        """Every step (module doc): ``(200, the answer)``; the session is the header's or
        the body's (``named_namespace``)."""
        svc = await self.service_of()
        req, ns = svc.admit(body, lambda s: named_namespace(s, session_header))
        async with svc.ordered(ns):
            resp = await svc.run(req, ns, self.backend)
        if self.conversations is not None:
            self.conversations.directive_ran(ns, req)  # what it forgot stays forgotten
        return 200, resp.model_dump(mode="json")

    async def flush_all(self) -> dict[str, Any]:
        """``POST /leyline/v1/flush``: the cache's part and the conversations; counters are
        untouched."""
        out = await (await self.service_of()).flush(DEFAULT_TENANT, self.backend)
        convs = self.conversations
        dropped = convs.forget_tenant(DEFAULT_TENANT) if convs is not None else 0
        return out.model_copy(update={"dropped_conversations": dropped}).model_dump(mode="json")


async def run_directive(
    req: DirectivesRequest,
    ns: Namespace,
    backend: DirectiveBackend[Any],
    tokenizer: Any,
    vocab_size: int,
    message_boundary_id: int | None,
) -> DirectivesResponse:
    """Steps 7-11 (module doc) for a checked request: compile, hold, decide, execute,
    release, count. What an engine's own callers (a chat turn's drift splice) run too."""
    t0 = time.perf_counter()
    compiled = compile_request(req, tokenizer, vocab_size, message_boundary_id, backend.executes)
    held, answer = None, None
    try:
        if compiled.needs_lookup:
            held = await backend.hold(compiled.base, ns)
        decision = decide(compiled, held.length if held is not None else 0, req)
        if isinstance(decision, Plan):
            answer = await executed(backend, decision, held, ns, compiled, req)
        else:
            answer = decision
    except LeylineError:
        await backend.count(ns, _count_error)
        raise
    finally:
        if held is not None:
            await backend.release(held, ns, answer)
    answer = answer.model_copy(update={"elapsed_s": time.perf_counter() - t0})
    done = answer
    await backend.count(ns, lambda c: c.count_directive(done))
    return answer


async def executed(
    backend: DirectiveBackend[Any],
    plan: Plan,
    held: Any,
    ns: Namespace,
    compiled: Compiled,
    req: DirectivesRequest,
) -> DirectivesResponse:
    """Step 10: ``backend.execute``. A backend finds some misses only when it checks the
    whole batch (a span the batch's earlier splices leave uncached on its storage, rows
    evicted since the lookup); its ``CacheMissError``, raised before the first write, is a
    miss like ``decide``'s: 409, or with ``req.fallback`` the ``fallback`` answer (nothing
    executed, counted in ``fallbacks``), on every backend alike."""
    try:
        return await backend.execute(plan, held, ns)
    except CacheMissError:
        if not req.fallback:
            raise
        return fallback_answer(compiled)


def _count_error(counters: Counters) -> None:
    counters.directive_errors += 1


def run_inline[R](coro: Coroutine[Any, Any, R]) -> R:
    """The result of a coroutine that never suspends (a backend that runs in the caller's
    thread); ``RuntimeError`` if it does suspend (it then needs an event loop)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("run_inline: the coroutine suspended; await it on an event loop")
