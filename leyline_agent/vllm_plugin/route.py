"""API-server side: ``POST /leyline/v1/directives``, ``GET /leyline/v1/stats``,
``POST /leyline/v1/flush``, as a ``vllm.endpoint_plugins`` plugin.

A directive goes through ``directives.service.DirectiveService``, as on ``leyline serve`` and
SGLang (parse, namespace, ``request_id``, model and limits, per-namespace order,
idempotence, compile, decide, counters). ``VLLMRoute`` is its ``DirectiveBackend`` over the
EngineCore ops (``engine_ops``), all in the directive's namespace (its salt, ``salt_for``):

- ``hold``: ``lock`` the base's cached full blocks (and the rows the plugin holds past them),
  held until ``release``, so nothing the decision counted on is evicted before it runs;
- ``execute``: every check that needs no write first (directives on, REPAIR's row forward
  known, ``T'`` within ``max_model_len``), then per directive, right to left (each on the
  sequence the previous one left):

  1. ``lock(stage=s)``: the working sequence's cached blocks, held;
  2. the head ``T[:s] + R`` as an ordinary vLLM request (one greedy token) through
     ``engine_client.generate``: vLLM's own prefill computes ``R`` over the cached prefix;
     its blocks are held when it finishes (``scheduler.HOLD_KEY``);
  3. ``splice``: the tail re-packed into fresh blocks with its keys rotated by ``delta`` on
     every worker, ``T'`` registered in the prefix cache. A REPAIR directive is this
     AMORTIZE, and inside the same op, before ``T'`` is registered, the workers recompute
     its selected tail rows (``row_forward``; the rows ``leyline serve`` selects,
     ``directives.repair``). In a batch each REPAIR directive is repaired on the sequence it
     leaves (``leyline serve`` repairs once, on the final ``T'``).

  A FORGET ``(s, e, R)`` stages ``T[:s]``'s rows, ``forget`` drops the namespace's cached
  blocks and held rows of ``T'`` past ``s``, then ``T'`` is an ordinary request;
- ``flush``: every pin, and every cached block no request holds.

Rows past a sequence's last full block are held by the plugin and handed to the next
request (``held_rows``, ``connector``). The EngineCore pins each splice's ``T'`` for the
namespace's next request (``pins``); the route remembers which namespaces it spliced in
(``watched``) so that only their requests ask the EngineCore (``arrive``) whether the result
was lost, which the answer then says (``pin_report``). Stats are the route's
``wire.Counters`` (directives, drift) with the EngineCore's request and cache counts.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from leyline_agent.chat_input import canonical_messages, canonical_tools
from leyline_agent.directives import Directive
from leyline_agent.directives.answers import error_content
from leyline_agent.directives.compile import render
from leyline_agent.directives.core import Mode
from leyline_agent.directives.flush import FlushResponse
from leyline_agent.directives.modes import executed_by, rule_of
from leyline_agent.directives.pipeline import Plan, applied_answer
from leyline_agent.directives.repair import DEFAULT_BUDGET, DEFAULT_SELECTOR
from leyline_agent.directives.service import DirectiveService, Flushed, ServedModel
from leyline_agent.directives.validate import RequestLimits, longest_token_bytes
from leyline_agent.errors import (
    CacheMissError,
    DirectiveError,
    RequestError,
    RuntimeUnavailableError,
)
from leyline_agent.families import chat_format, token_id
from leyline_agent.front.conversations import ConversationStore
from leyline_agent.http import guards as http_guards
from leyline_agent.namespaces import DEFAULT_TENANT, SESSION_HEADER, Namespace, named_namespace
from leyline_agent.vllm_plugin.guard import BODY_KEY
from leyline_agent.vllm_plugin.namespace import salt_for
from leyline_agent.vllm_plugin.ops import (
    ArriveOp,
    DescribeAnswer,
    DescribeOp,
    FlushOp,
    ForgetOp,
    LockOp,
    Op,
    ReleaseOp,
    RepairBudget,
    SpliceOp,
    StatsOp,
)
from leyline_agent.vllm_plugin.pins import DEFAULT_WATCHED
from leyline_agent.vllm_plugin.scheduler import HOLD_KEY
from leyline_agent.wire import (
    BODY_EDITS,
    CLIENT_EDITS,
    Counters,
    DirectivesRequest,
    DirectivesResponse,
)

if TYPE_CHECKING:
    from starlette.datastructures import State
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["EXECUTES", "Locked", "VLLMRoute", "add_routes"]

log = structlog.get_logger(__name__)
Work = Callable[["VLLMRoute"], Awaitable[tuple[int, dict[str, object]]]]  # a route's job
_ERROR_TYPES = {
    "CacheMissError": CacheMissError,
    "DirectiveError": DirectiveError,
    "RuntimeUnavailableError": RuntimeUnavailableError,
}
# REPAIR runs as AMORTIZE, then the workers recompute its selected tail rows in place
# (``row_forward``); a model whose layers the row forward does not know is refused (503).
ROW_OPS = frozenset({"move", "prefill", "recompute"})
EXECUTES = executed_by(ROW_OPS)


@dataclasses.dataclass(frozen=True, slots=True)
class Locked:
    """``hold``'s answer: the first ``length`` tokens of the base are cached, held by
    ``lock_id`` (None: nothing cached, nothing held)."""

    length: int
    lock_id: str | None


class VLLMRoute:
    """The plugin's app state: the directive service and its backend on vLLM's engine client,
    the chat front's conversations and renderer, and the counters ``/leyline/v1/stats``
    reads."""

    def __init__(self, engine_client: AsyncLLM, model_names: list[str]) -> None:
        self.engine = engine_client
        self.model_names = model_names
        self.counters = Counters()
        self.conversations = ConversationStore()  # the chat front's (``front.chat_proxy``)
        self.watched: OrderedDict[str, None] = OrderedDict()  # salts with a pinned result
        self.app_state: State | None = None  # the app's (``render_chat``; set by init_state)
        self._info: DescribeAnswer | None = None
        self._service: DirectiveService | None = None
        self._warned_render = False

    @property
    def executes(self) -> frozenset[Mode]:
        return EXECUTES

    # -- engine calls --------------------------------------------------------------------
    async def rpc[A: BaseModel](self, op: Op[A]) -> A:
        """Run ``op`` in the EngineCore (``engine_ops``): its answer, or its error raised."""
        raw = await self.engine.engine_core.call_utility_async("leyline_rpc", op.model_dump_json())
        answer = json.loads(raw)
        if "error" in answer:
            err = answer["error"]
            cls = _ERROR_TYPES.get(err["type"])
            if cls is None:
                raise RuntimeError(f"{err['type']}: {err['message']}")
            raise cls(err["message"])
        return op.read(answer["ok"])

    def tokenizer(self) -> TokenizerLike:
        """The served model's tokenizer (the one vLLM's chat route renders with)."""
        return self.engine.get_tokenizer()

    async def render_chat(
        self,
        messages: list[dict[str, object]],
        tools: list[object] | None,
        kwargs: dict[str, object],
    ) -> list[int]:
        """The prompt vLLM's chat route renders for ``messages`` and ``tools``: vLLM's own
        renderer (what its ``/tokenize`` runs, ``app_state.serving_tokenization``), so that
        the chat front diffs and splices the very tokens vLLM will prefill. Without it (an
        app that has none), the tokenizer's chat template, said once in the log."""
        serving = getattr(self.app_state, "serving_tokenization", None)
        if serving is None:
            if not self._warned_render:
                log.warning("leyline renders chats with the tokenizer: vLLM's renderer is absent")
                self._warned_render = True
            generation = bool(kwargs.get("add_generation_prompt", True))
            tools_ = canonical_tools(tools)
            return render(self.tokenizer(), canonical_messages(messages), tools_, generation)
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

        body = {"model": self.model_names[0], "messages": messages, "tools": tools, **kwargs}
        try:
            req = TokenizeChatRequest.model_validate(body)
        except ValueError as e:
            raise RequestError(f"vLLM cannot render these messages: {e}", "messages") from e
        out = await serving.create_tokenize(req, None)
        tokens = getattr(out, "tokens", None)
        if tokens is None:  # vLLM's ErrorResponse
            raise RequestError(f"vLLM cannot render these messages: {out}", "messages")
        return list(tokens)

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

    async def prefill(self, ids: list[int], salt: str, hold_id: str | None = None) -> None:
        """One ordinary request for ``ids`` (one greedy token) in namespace ``salt``."""
        from vllm.sampling_params import SamplingParams

        params = SamplingParams(
            max_tokens=1, temperature=0.0, extra_args={HOLD_KEY: hold_id} if hold_id else None
        )
        prompt = {"prompt_token_ids": list(ids), "cache_salt": salt}
        rid = f"leyline-{'head' if hold_id else 'forget'}-{uuid.uuid4().hex}"
        async for _ in self.engine.generate(prompt, params, rid):
            pass

    async def arrive(self, salt: str) -> bool:
        """A request of namespace ``salt`` is about to be served: True (once) if the
        namespace's last splice result was lost meanwhile (``engine_ops`` ``arrive``). Only
        namespaces this route spliced in are asked about; the others answer False at once."""
        if salt not in self.watched:
            return False
        done = await self.rpc(ArriveOp(salt=salt))
        if not done.watched:
            self.watched.pop(salt, None)
        return done.lost

    def _watch(self, salt: str) -> None:
        self.watched[salt] = None
        self.watched.move_to_end(salt)
        while len(self.watched) > DEFAULT_WATCHED:  # the scheduler's bound too
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

    async def directives(
        self, body: object, session_header: str | None
    ) -> tuple[int, dict[str, object]]:
        """``POST /leyline/v1/directives``: (status, JSON body)."""
        try:
            svc = await self.service()
            req, ns = svc.admit(body, lambda s: named_namespace(s, session_header))
            async with svc.ordered(ns):
                resp = await svc.run(req, ns, self)
        except Exception as e:  # noqa: BLE001 - every failure is an answer
            status, content = error_content(e)
            if status >= 500:
                log.error("leyline directive failed", error=repr(e))
            return status, content
        self.conversations.directive_ran(ns, req)  # what it forgot stays forgotten
        return 200, resp.model_dump(mode="json")

    async def run_edits(self, req: DirectivesRequest, session: str) -> DirectivesResponse:
        """A message-form directive made by the chat front (``front.chat_proxy``: a chat
        request's ``leyline.edits``), checked and run by the service in the session's order
        (``DirectiveService.run_made``), and counted; a failure is raised."""
        ns = named_namespace(req.session, session, server_made=True)
        return await (await self.service()).run_made(req, ns, self)

    # -- DirectiveBackend ----------------------------------------------------------------
    async def hold(self, base: list[int], ns: Namespace) -> Locked:
        await self._on()
        lock = await self.rpc(LockOp(tokens=base, salt=salt_for(ns)))
        return Locked(lock.cached_tokens, lock.lock_id)

    async def release(self, held: Locked, ns: Namespace, answer: DirectivesResponse | None) -> None:
        if held.lock_id is not None:
            await self.rpc(ReleaseOp(ids=(held.lock_id,)))

    async def count(self, ns: Namespace, update: Callable[[Counters], None]) -> None:
        update(self.counters)

    async def execute(self, plan: Plan, held: Locked, ns: Namespace) -> DirectivesResponse:
        info = await self._on()  # the checks before the first write
        if len(plan.new_tokens) > info.max_model_len:
            n, limit = len(plan.new_tokens), info.max_model_len
            raise DirectiveError(f"directives: T' has {n} tokens > max_model_len {limit}")
        if any(rule_of(d.mode, EXECUTES).repairs for d in plan.order):
            problem = info.workers[0].repair_problem if info.workers else None
            if problem:
                raise RuntimeUnavailableError(problem)
        resp = await self._splice(plan, salt_for(ns))
        self.counters.prefilled_tokens += resp.prefilled_tokens  # the plugin's own requests
        return resp

    async def flush(self, tenant: str) -> Flushed:
        await self._on()
        done = await self.rpc(FlushOp())
        self.watched.clear()
        return Flushed(done.flushed_tokens, done.kept_tokens, done.dropped_pins)

    async def _splice(self, plan: Plan, salt: str) -> DirectivesResponse:
        cur = list(plan.base)
        splices = {"amortize": 0, "forget": 0}
        reused = prefilled = rotated = repaired = 0
        for d in plan.order:  # right to left
            assert isinstance(d.replacement, list)  # compiled by the pipeline
            after = cur[: d.start] + d.replacement + cur[d.end :]
            rule = rule_of(d.mode, EXECUTES)
            if rule.moves_tail:
                # stage: T's rows inside the block holding ``start`` go to the head
                lock = await self.rpc(LockOp(tokens=cur, salt=salt, stage=d.start))
                c = lock.cached_tokens
                if d.end > c and c <= d.start:
                    # An earlier directive of the batch (to the right) left T' cached in full
                    # blocks only: nothing of this span is cached now, the next request
                    # prefills it (the tokens still change).
                    await self.rpc(ReleaseOp(ids=(lock.lock_id,)))
                    cur = after
                    continue
                end = min(d.end, c)  # straddling the cached end: (start, c, R), as clip_to_cached
                hold_id = "head-" + uuid.uuid4().hex
                try:
                    await self.prefill(cur[: d.start] + d.replacement, salt, hold_id)
                    done = await self.rpc(SpliceOp(
                        lock_id=lock.lock_id, hold_id=hold_id, tokens=cur, start=d.start,
                        end=end, replacement=d.replacement, salt=salt,
                        repair=_repair_of(d) if rule.repairs else None,
                    ))  # fmt: skip
                except BaseException:
                    await self.rpc(ReleaseOp(ids=(lock.lock_id, hold_id)))
                    raise
                reused += d.start
                prefilled += d.start + len(d.replacement) - done.head_cached_tokens
                rotated += done.rotated_tokens
                repaired += done.repaired_tokens
            else:
                # the rows before ``start`` stay: those inside its block are staged for the
                # re-prefill, which computes from ``start`` on
                await self.rpc(ForgetOp(tokens=after, start=d.start, salt=salt, stage=cur))
                await self.prefill(after, salt)
                reused += d.start
                prefilled += len(after) - d.start
            splices[d.mode.value] = splices.get(d.mode.value, 0) + 1
            cur = after
            self._watch(salt)  # the EngineCore pinned T' (engine_ops: splice, forget)
        return applied_answer(
            plan, splices=splices, reused=reused, prefilled=prefilled, rotated=rotated,
            repaired=repaired,
        )  # fmt: skip

    # -- flush and stats -----------------------------------------------------------------
    async def flush_all(self) -> dict[str, object]:
        """``/leyline/v1/flush`` (one tenant): the cache's part (``flush``) and the chat
        front's conversations. Counters are untouched."""
        out: FlushResponse = await (await self.service()).flush(DEFAULT_TENANT, self)
        dropped = self.conversations.forget_tenant(DEFAULT_TENANT)
        return out.model_copy(update={"dropped_conversations": dropped}).model_dump(mode="json")

    async def stats(self) -> dict[str, object]:
        """The route's counters with the EngineCore's request and cache counts: a
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
    """What the EngineCore's ``splice`` needs to REPAIR ``d``: its budget (the default where
    it gives none) and the selector, those ``leyline serve`` uses by default."""
    budget = DEFAULT_BUDGET if d.budget is None else d.budget
    return RepairBudget(budget=budget, selector=DEFAULT_SELECTOR)


def add_routes(app: FastAPI) -> None:
    """``/leyline/v1/directives``, ``/leyline/v1/stats``, ``/leyline/v1/flush``. Their key
    check, body cap and JSON checks are ``guard.LeylineGuard``'s (in front of every route);
    a route reached without it (a test app) parses its body with the same checks."""

    def route_of(request: Request) -> VLLMRoute:
        route = getattr(request.app.state, "leyline", None)
        if route is None:
            raise RuntimeUnavailableError("the Leyline route has no engine")
        return route

    async def answer(request: Request, work: Work) -> JSONResponse:
        try:
            status, content = await work(route_of(request))
        except Exception as e:  # noqa: BLE001 - every failure is an answer
            status, content = error_content(e)
            if status >= 500:
                log.error("leyline route failed", path=request.url.path, error=repr(e))
        return JSONResponse(content, status_code=status)

    async def body_of(request: Request) -> object:
        if BODY_KEY in request.scope:
            return request.scope[BODY_KEY]
        raw = await request.body()
        return http_guards.parse_json(raw) if raw.strip() else None

    async def directives(request: Request) -> JSONResponse:
        async def work(route: VLLMRoute) -> tuple[int, dict[str, object]]:
            body = await body_of(request)  # a refused body changes no counter
            return await route.directives(body, request.headers.get(SESSION_HEADER))

        return await answer(request, work)

    async def stats(request: Request) -> JSONResponse:
        async def work(route: VLLMRoute) -> tuple[int, dict[str, object]]:
            return 200, await route.stats()

        return await answer(request, work)

    async def flush(request: Request) -> JSONResponse:
        async def work(route: VLLMRoute) -> tuple[int, dict[str, object]]:
            body = await body_of(request)
            if body not in (None, {}):
                raise http_guards.GuardError(
                    "this route takes no fields; send no body or {}", "body"
                )
            return 200, await route.flush_all()

        return await answer(request, work)

    app.add_api_route("/leyline/v1/directives", directives, methods=["POST"])
    app.add_api_route("/leyline/v1/stats", stats, methods=["GET"])
    app.add_api_route("/leyline/v1/flush", flush, methods=["POST"])
