"""The directive service's backend over an engine in another process (torch-free).

A server whose engine runs in another process (vLLM's API server and EngineCore) reaches
its prefix cache through ``directives.engine_rpc``'s ops, and prefills through the engine's
own request path. ``RemoteEngineBackend`` is the ``DirectiveBackend`` (``directives.service``)
over such an engine, every op in the directive's namespace (the engine's key of it,
``EngineTransport.salt_for``); the engine's calls are an ``EngineTransport`` (vLLM's:
``vllm_plugin.route``):

- ``hold``: ``lock`` the base's cached rows, held until ``release``, so nothing the decision
  counted on is evicted before it runs;
- ``execute``: every check that needs no write first (directives on, REPAIR's row forward
  known, ``T'`` within ``max_model_len``, each span still cached once the splices to its
  right are written: ``splice_plan.batch_miss``, a miss the service answers as any other),
  then per directive, right to left (each on the sequence the previous one left):

  1. ``lock(stage=s)``: the working sequence's cached rows, held (the first directive's
     sequence is the base ``hold`` holds: its lock stages without holding again, and the
     splice gives back ``hold``'s lock, one engine call less);
  2. the head ``T[:s] + R`` as an ordinary request of the engine (``prefill``): its own
     prefill computes ``R`` over the cached prefix, and its rows are held under ``hold_id``
     when it finishes;
  3. ``splice``: the tail's rows moved into fresh rows with their keys rotated by ``delta``,
     ``T'`` registered in the prefix cache. A REPAIR directive is this AMORTIZE, and inside
     the same op, before ``T'`` is registered, its selected tail rows are recomputed (the
     rows ``leyline serve`` selects, ``directives.repair``). In a batch each REPAIR
     directive is repaired on the sequence it leaves (``leyline serve`` repairs once, on
     the final ``T'``).

  Where every worker can compute rows itself (``WorkerDescription.repair_problem`` None:
  the row forward REPAIR uses), steps 1 and 2 go: the splice op computes ``R``'s rows in
  their fresh slots over ``T[:s]``'s cached rows (``SpliceOp.hold_id`` None), one engine call
  per directive (the first directive's lock is ``hold``'s); a directive then costs no request
  of the engine at all. Any other model keeps the head request.

  A failure after the lock gives back the lock and the head's hold. A FORGET ``(s, e, R)``
  stages ``T[:s]``'s rows, ``forget`` drops the namespace's cached rows of ``T'`` past
  ``s``, then ``T'`` is an ordinary request;
- ``flush``: every pin, and every cached row no request holds.

The engine pins each splice's ``T'`` for the namespace's next request; the backend
remembers which namespaces it spliced in (``watched``) so that only their requests ask the
engine (``arrive``) whether the result was lost (``front.pin_report`` says so in the
answer). Stats are the backend's ``wire.Counters`` (directives, drift) with the engine's
request and cache counts. The backend also serves the chat front (``front.chat_proxy``'s
``EditRunner``: ``run_edits``, ``render_chat``, ``tokenizer``, ``conversations``).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import structlog
from pydantic import BaseModel

from leyline_agent.chat_input import canonical_messages, canonical_tools
from leyline_agent.directives.compile import render
from leyline_agent.directives.core import Directive, Mode
from leyline_agent.directives.engine_rpc import (
    ArriveOp,
    DescribeAnswer,
    DescribeOp,
    FlushOp,
    ForgetOp,
    LockAnswer,
    LockOp,
    Op,
    ReleaseOp,
    RepairBudget,
    SpliceOp,
    StatsOp,
    read_reply,
)
from leyline_agent.directives.modes import rule_of
from leyline_agent.directives.pin_table import DEFAULT_WATCHED
from leyline_agent.directives.pipeline import Plan, applied_answer
from leyline_agent.directives.repair import DEFAULT_BUDGET, DEFAULT_SELECTOR
from leyline_agent.directives.service import (
    Conversations,
    DirectiveService,
    Flushed,
    PluginMount,
    ServedModel,
)
from leyline_agent.directives.splice_plan import batch_miss, splice_counts, tail_op
from leyline_agent.directives.validate import RequestLimits, longest_token_bytes
from leyline_agent.errors import CacheMissError, DirectiveError, RuntimeUnavailableError
from leyline_agent.families import chat_format, token_id
from leyline_agent.namespaces import Namespace, named_namespace
from leyline_agent.wire import (
    BODY_EDITS,
    CLIENT_EDITS,
    Counters,
    DirectivesRequest,
    DirectivesResponse,
)

__all__ = ["EngineTransport", "Locked", "RemoteEngineBackend"]

log = structlog.get_logger(__name__)


class EngineTransport(Protocol):
    """How the front process reaches one engine in another process."""

    def salt_for(self, ns: Namespace) -> str:
        """The engine's key of the Leyline namespace ``ns``."""
        ...

    async def call(self, request_json: str) -> str:
        """One ``engine_rpc`` op run in the engine process, between two engine steps: its
        reply's JSON."""
        ...

    async def prefill(self, ids: list[int], salt: str, hold_id: str | None) -> None:
        """``ids`` as an ordinary request (one greedy token) in namespace ``salt``; its rows
        held under ``hold_id`` when it finishes (None: not held)."""
        ...

    def tokenizer(self) -> Any:
        """The served model's tokenizer (the one the engine's chat route renders with)."""
        ...

    async def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any]
    ) -> list[int] | None:
        """The prompt the engine's own chat route renders (None: the engine has no renderer
        here; the tokenizer's chat template renders it, said once in the log)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class Locked:
    """``hold``'s answer: the first ``length`` tokens of the base are cached, held by
    ``lock_id`` (None: nothing cached, nothing held)."""

    length: int
    lock_id: str | None


class RemoteEngineBackend[C: Conversations]:
    """The directive service and its backend over ``transport``, the chat front's
    ``conversations`` and renderer, and the counters ``/leyline/v1/stats`` reads (module
    doc). ``executes``: the modes whose row operations the engine implements."""

    def __init__(
        self,
        transport: EngineTransport,
        model_names: list[str],
        conversations: C,
        executes: frozenset[Mode],
    ) -> None:
        self.transport = transport
        self.model_names = model_names
        self.conversations = conversations
        self.executes = executes
        self.counters = Counters()
        self.watched: OrderedDict[str, None] = OrderedDict()  # salts with a pinned result
        self._info: DescribeAnswer | None = None
        self._service: DirectiveService | None = None
        self._warned_render = False
        self._given_back: set[str] = set()  # hold locks a splice released (``_splice``)
        # the three Leyline routes' answers (``http.directive_routes``)
        self.mount = PluginMount(self, self.service, self.stats, conversations)

    # -- engine calls --------------------------------------------------------------------
    async def rpc[A: BaseModel](self, op: Op[A]) -> A:
        """Run ``op`` in the engine process: its answer, or its error raised."""
        return read_reply(op, await self.transport.call(op.model_dump_json()))

    def tokenizer(self) -> Any:
        return self.transport.tokenizer()

    async def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any]
    ) -> list[int]:
        """The prompt the engine's chat route renders for ``messages`` and ``tools``, so that
        the chat front diffs and splices the very tokens the engine will prefill."""
        tokens = await self.transport.render_chat(messages, tools, kwargs)
        if tokens is not None:
            return tokens
        if not self._warned_render:
            log.warning("leyline renders chats with the tokenizer: the engine's renderer is absent")
            self._warned_render = True
        generation = bool(kwargs.get("add_generation_prompt", True))
        return render(
            self.tokenizer(), canonical_messages(messages), canonical_tools(tools), generation
        )

    async def info(self) -> DescribeAnswer:
        if self._info is None:
            self._info = await self.rpc(DescribeOp())
        return self._info

    async def _on(self) -> DescribeAnswer:
        """``describe``'s facts; 503 naming the setting at fault if directives are off."""
        info = await self.info()
        if info.problem:
            raise RuntimeUnavailableError(f"{info.problem} (Leyline directives are off)")
        return info

    async def arrive(self, salt: str) -> bool:
        """A request of namespace ``salt`` is about to be served: True (once) if the
        namespace's last splice result was lost meanwhile (``arrive``). Only namespaces this
        backend spliced in are asked about; the others answer False at once."""
        if salt not in self.watched:
            return False
        done = await self.rpc(ArriveOp(salt=salt))
        if not done.watched:
            self.watched.pop(salt, None)
        return done.lost

    def _watch(self, salt: str) -> None:
        self.watched[salt] = None
        self.watched.move_to_end(salt)
        while len(self.watched) > DEFAULT_WATCHED:  # the engine's pin table's bound too
            self.watched.popitem(last=False)

    # -- the service ---------------------------------------------------------------------
    async def service(self) -> DirectiveService:
        """The ``DirectiveService`` of the served model (made on first use): its names, the
        vocabulary, ``max_model_len``, the longest token's bytes, the chat format."""
        if self._service is None:
            info, tok = await self.info(), self.tokenizer()
            limits = RequestLimits(info.vocab_size, info.max_model_len, longest_token_bytes(tok))
            boundary = token_id(tok, chat_format(info.model_type).message_boundary)
            model = ServedModel(
                self.model_names[0], tok, limits, boundary, tuple(self.model_names[1:])
            )
            self._service = DirectiveService(model)
        return self._service

    async def run_edits(self, req: DirectivesRequest, session: str) -> DirectivesResponse:
        """A message-form directive made by the chat front (``front.chat_proxy``: a chat
        request's ``leyline.edits``), checked and run by the service in the session's order
        (``DirectiveService.run_made``), and counted; a failure is raised."""
        ns = named_namespace(req.session, session, server_made=True)
        return await (await self.service()).run_made(req, ns, self)

    # -- DirectiveBackend ----------------------------------------------------------------
    async def hold(self, base: list[int], ns: Namespace) -> Locked:
        await self._on()
        lock = await self.rpc(LockOp(tokens=base, salt=self.transport.salt_for(ns)))
        return Locked(lock.cached_tokens, lock.lock_id)

    async def release(self, held: Locked, ns: Namespace, answer: DirectivesResponse | None) -> None:
        if held.lock_id in self._given_back:  # the splice gave it back
            self._given_back.discard(held.lock_id)
        elif held.lock_id is not None:
            await self.rpc(ReleaseOp(ids=(held.lock_id,)))

    async def count(self, ns: Namespace, update: Callable[[Counters], None]) -> None:
        update(self.counters)

    async def execute(self, plan: Plan, held: Locked, ns: Namespace) -> DirectivesResponse:
        info = await self._on()  # the checks before the first write
        if len(plan.new_tokens) > info.max_model_len:
            n, limit = len(plan.new_tokens), info.max_model_len
            raise DirectiveError(f"directives: T' has {n} tokens > max_model_len {limit}")
        unit = 1 if info.held_rows else info.block_size or 1  # no rows held past full blocks
        miss = batch_miss(plan.order, held.length, unit)
        if miss is not None:  # answered as a miss by the service: 409, or a fallback
            raise CacheMissError(miss)
        if any(rule_of(d.mode, self.executes).repairs for d in plan.order):
            problem = info.workers[0].repair_problem if info.workers else None
            if problem:
                raise RuntimeUnavailableError(problem)
        fills = bool(info.workers) and all(w.repair_problem is None for w in info.workers)
        resp = await self._splice(plan, self.transport.salt_for(ns), held, fills)
        self.counters.prefilled_tokens += resp.prefilled_tokens  # the backend's own requests
        return resp

    async def flush(self, tenant: str) -> Flushed:
        await self._on()
        done = await self.rpc(FlushOp())
        self.watched.clear()
        return Flushed(done.flushed_tokens, done.kept_tokens, done.dropped_pins)

    async def _splice(self, plan: Plan, salt: str, held: Locked, fills: bool) -> DirectivesResponse:
        """The plan's directives, right to left; ``fills``: the engine computes ``R``'s rows
        inside its splice op (no head request, no staging)."""
        cur = list(plan.base)
        reused = prefilled = rotated = repaired = 0
        for i, d in enumerate(plan.order):  # right to left
            assert isinstance(d.replacement, list)  # compiled by the pipeline
            after = cur[: d.start] + d.replacement + cur[d.end :]
            rule = rule_of(d.mode, self.executes)
            if tail_op(d.mode) == "move":
                # on the base, ``hold``'s lock holds T's rows already and the splice gives it
                # back; without fills, the lock stages T's rows inside the block holding
                # ``start`` for the head request
                on_base = held.lock_id if i == 0 else None  # holds ``plan.base``'s rows
                if on_base and fills:
                    lock = LockAnswer(lock_id=None, cached_tokens=held.length, salt=salt)
                else:
                    lock = await self.rpc(LockOp(
                        tokens=cur, salt=salt, stage=None if fills else d.start,
                        hold=on_base is None,
                    ))  # fmt: skip
                lock_id = on_base or lock.lock_id
                c = min(lock.cached_tokens, held.length) if on_base else lock.cached_tokens
                if d.end > c and c <= d.start:  # evicted since ``batch_miss`` checked
                    if not on_base:
                        await self.rpc(ReleaseOp(ids=(lock_id,)))
                    raise CacheMissError(
                        f"directives: span [{d.start}, {d.end}) was evicted between the "
                        "batch's splices (those to its right are written)"
                    )
                end = min(d.end, c)  # straddling the cached end: (start, c, R), as clip_to_cached
                hold_id = None if fills else "head-" + uuid.uuid4().hex
                if on_base:  # released by the splice op, or below on a failure
                    self._given_back.add(on_base)
                try:
                    if hold_id is not None:
                        await self.transport.prefill(cur[: d.start] + d.replacement, salt, hold_id)
                    done = await self.rpc(SpliceOp(
                        lock_id=lock_id, hold_id=hold_id, tokens=cur, start=d.start,
                        end=end, replacement=d.replacement, salt=salt,
                        repair=_repair_of(d) if rule.repairs else None,
                    ))  # fmt: skip
                except BaseException:
                    await self.rpc(ReleaseOp(ids=(lock_id, hold_id)))
                    raise
                reused += d.start
                prefilled += d.start + len(d.replacement) - done.head_cached_tokens
                rotated += done.rotated_tokens
                repaired += done.repaired_tokens
            else:  # "prefill" (``tail_op`` refuses any other tail)
                # the rows before ``start`` stay: those inside its block are staged for the
                # re-prefill, which computes from ``start`` on
                await self.rpc(ForgetOp(tokens=after, start=d.start, salt=salt, stage=cur))
                await self.transport.prefill(after, salt, None)
                reused += d.start
                prefilled += len(after) - d.start
            cur = after
            self._watch(salt)  # the engine pinned T' (its splice and forget ops)
        splices = splice_counts(plan.order)
        return applied_answer(
            plan, splices=splices, reused=reused, prefilled=prefilled, rotated=rotated,
            repaired=repaired,
        )  # fmt: skip

    # -- stats -------------------------------------------------------------------------
    async def stats(self) -> dict[str, object]:
        """The backend's counters with the engine's request and cache counts: a
        directive's own prefills are counted on top of the requests'."""
        s = await self.rpc(StatsOp())
        c = self.counters
        counts = dataclasses.replace(
            c,
            requests=s.requests,
            prompt_tokens=s.prompt_tokens,
            cached_tokens=s.cached_tokens,
            prefilled_tokens=s.prompt_tokens - s.cached_tokens + c.prefilled_tokens,
            generated_tokens=s.generated_tokens,
            pin_evictions=s.pin_evictions,
        )
        return counts.to_stats(
            cache_tokens=s.cache_tokens,
            cache_capacity_tokens=s.cache_capacity_tokens,
            pinned_tokens=s.pinned_tokens,
            features=(BODY_EDITS, CLIENT_EDITS),  # front.chat_proxy applies them
        ).model_dump(mode="json")


def _repair_of(d: Directive) -> RepairBudget:
    """What the engine's ``splice`` needs to REPAIR ``d``: its budget (the default where it
    gives none) and the selector, those ``leyline serve`` uses by default."""
    budget = DEFAULT_BUDGET if d.budget is None else d.budget
    return RepairBudget(budget=budget, selector=DEFAULT_SELECTOR)
