"""API-server side: ``POST /leyline/v1/directives``, ``GET /leyline/v1/stats`` and the
``X-Leyline-Session`` middleware, as a ``vllm.endpoint_plugins`` plugin.

A request goes through ``directives.pipeline`` as on every backend: compiled, the cached
length of its base asked of the EngineCore (``cached_prefix``: a ``lock`` released at once),
then decided: a miss (``CacheMissError``, 409, or the ``fallback`` answer), a noop, or a plan
on the cached prefix, nothing held or changed until then.

Execution of one AMORTIZE ``(s, e, R)`` of the plan (directives run right to left, each on
the sequence the previous one left), all calls in the directive's namespace (its salt):

1. ``lock`` (EngineCore): the working sequence's cached full blocks, held;
2. the head ``T[:s] + R`` as an ordinary vLLM request (one greedy token) through
   ``engine_client.generate``: vLLM's own prefill computes ``R`` over the cached prefix; its
   blocks are held when it finishes (``scheduler.HOLD_KEY``);
3. ``splice`` (EngineCore): the tail re-packed into fresh blocks with its keys rotated by
   ``delta`` on every worker, ``T'`` registered in the prefix cache. A REPAIR directive is
   this AMORTIZE, and inside the same op, before ``T'`` is registered, the workers recompute
   its selected tail rows in their fresh slots (``row_forward``; the rows ``leyline serve``
   selects, ``directives.repair``, at the directive's budget or ``DEFAULT_BUDGET``). In a
   batch each REPAIR directive is repaired on the sequence it leaves (``leyline serve``
   repairs once, on the final ``T'``): one REPAIR directive is the same on both.

Rows past a sequence's last full block are held by the plugin and handed to the next
request (``held_rows``, ``connector``): ``lock`` counts them as cached and, with ``stage``,
hands ``T[block_start(s):s]`` to the head, so ``R`` is prefilled over the rows the session
holds. FORGET ``(s, e, R)``: ``T[:s]``'s rows are staged the same way, ``forget`` drops the
namespace's cached blocks and held rows of ``T'`` past ``s``, then ``T'`` is an ordinary
request that computes from ``s`` on. The EngineCore pins each splice's ``T'`` for the
namespace's next request (``pins``); the route remembers which namespaces it spliced in
(``watched``) so that only their requests ask the EngineCore (``arrive``) whether the result
was lost, which the answer then says (``pin_report``). Everything that can be checked
without the cache (the body, the model name, token ids, spans, the setup the plugin
supports) is checked before any of these calls. Directives of one namespace are serialized (one lock per salt); namespaces run side by side.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from typing import Any

import structlog
from fastapi import Request
from fastapi.responses import JSONResponse

from leyline_agent.chat_input import canonical_messages, canonical_tools
from leyline_agent.directives import Directive, http_guards
from leyline_agent.directives.compile import render
from leyline_agent.directives.flush import FlushResponse
from leyline_agent.directives.idempotence import RequestMemory, check_request_id, fingerprint
from leyline_agent.directives.modes import executed_by, rule_of
from leyline_agent.directives.pipeline import (
    Plan,
    TokenForm,
    applied_answer,
    compile_request,
    decide,
)
from leyline_agent.directives.repair import DEFAULT_BUDGET, DEFAULT_SELECTOR
from leyline_agent.directives.validate import (
    RequestLimits,
    check_served,
    checked,
    longest_token_bytes,
    parse_directives,
)
from leyline_agent.errors import (
    CacheMissError,
    DirectiveError,
    RequestError,
    RuntimeUnavailableError,
)
from leyline_agent.families import chat_format, token_id
from leyline_agent.front.conversations import ConversationStore
from leyline_agent.namespaces import DEFAULT_TENANT, SESSION_HEADER, named_namespace
from leyline_agent.vllm_plugin.errors import error_content
from leyline_agent.vllm_plugin.guard import BODY_KEY
from leyline_agent.vllm_plugin.namespace import salt_for
from leyline_agent.vllm_plugin.pins import DEFAULT_WATCHED
from leyline_agent.vllm_plugin.scheduler import HOLD_KEY
from leyline_agent.wire import (
    BODY_EDITS,
    CLIENT_EDITS,
    DirectivesRequest,
    DirectivesResponse,
    StatsResponse,
)

__all__ = ["EXECUTES", "VLLMRoute", "add_routes"]

log = structlog.get_logger(__name__)
_ERROR_TYPES = {
    "CacheMissError": CacheMissError,
    "DirectiveError": DirectiveError,
    "RuntimeUnavailableError": RuntimeUnavailableError,
}
# REPAIR runs as AMORTIZE, then the workers recompute its selected tail rows in place
# (``row_forward``); a model whose layers the row forward does not know is refused (503).
ROW_OPS = frozenset({"move", "prefill", "recompute"})
EXECUTES = executed_by(ROW_OPS)
_MEMORY = 1024  # request ids remembered per namespace for idempotent retries


class VLLMRoute:
    def __init__(self, engine_client: Any, model_names: list[str]) -> None:
        self.engine = engine_client
        self.model_names = model_names
        self.splices = {"amortize": 0, "forget": 0}
        self.rotated_tokens = 0
        self.prefilled_tokens = 0
        self.repaired_tokens = 0
        self.fallbacks = 0
        self.directive_errors = 0
        self.drift_splices = 0  # chat turns whose token drift was spliced (chat_front)
        self.drift_unspliced: dict[str, int] = {}  # ... found but not spliced, by reason
        self._locks: dict[str, asyncio.Lock] = {}  # one per namespace (salt)
        self._info: dict[str, Any] | None = None
        self._limits: RequestLimits | None = None
        self.memory: RequestMemory[dict[str, Any]] = RequestMemory(_MEMORY)
        self.watched: OrderedDict[str, None] = OrderedDict()  # salts with a pinned result
        self.conversations = ConversationStore()  # the chat front's (``chat_front``)
        self.app_state: Any = None  # the app's state (``render_chat``; set by init_state)
        self._warned_render = False

    # -- engine calls --------------------------------------------------------------------
    async def rpc(self, op: str, **kwargs: Any) -> dict[str, Any]:
        raw = await self.engine.engine_core.call_utility_async(
            "leyline_rpc", json.dumps({"op": op, **kwargs})
        )
        answer = json.loads(raw)
        if "error" in answer:
            err = answer["error"]
            cls = _ERROR_TYPES.get(err["type"])
            if cls is None:
                raise RuntimeError(f"{err['type']}: {err['message']}")
            raise cls(err["message"])
        return answer["ok"]

    def tokenizer(self) -> Any:
        """The served model's tokenizer (the one vLLM's chat route renders with)."""
        return self.engine.get_tokenizer()

    async def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any]
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

    async def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = await self.rpc("describe")
        return self._info

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
        done = await self.rpc("arrive", salt=salt)
        if not done["watched"]:
            self.watched.pop(salt, None)
        return bool(done["lost"])

    def _watch(self, salt: str) -> None:
        self.watched[salt] = None
        self.watched.move_to_end(salt)
        while len(self.watched) > DEFAULT_WATCHED:  # the scheduler's bound too
            self.watched.popitem(last=False)

    async def limits(self) -> RequestLimits:
        """The bounds every directive is checked against, as ``leyline serve`` checks them
        (``directives.validate``): the vocabulary, ``max_model_len``, the longest token's
        bytes (found once)."""
        if self._limits is None:
            info = await self.info()
            tok = self.engine.get_tokenizer() if hasattr(self.engine, "get_tokenizer") else None
            longest = longest_token_bytes(tok) if tok is not None else None
            self._limits = RequestLimits(
                int(info["vocab_size"]), int(info["max_model_len"]), longest
            )
        return self._limits

    # -- the directive route ---------------------------------------------------------------
    async def directives(self, body: Any, session_header: str | None) -> tuple[int, dict[str, Any]]:
        t0 = time.perf_counter()
        try:  # the checks every Leyline front runs, in the same order (``leyline_routes``)
            req = parse_directives(body)
            ns = named_namespace(req.session, session_header)
            key = salt_for(ns)
            check_request_id(req.request_id)
            check_served(req.model, self.model_names[0], self.model_names[1:])
            req = checked(req, await self.limits())
        except Exception as e:  # noqa: BLE001 - a bad request is an answer too
            self.directive_errors += 1
            return error_content(e)
        digest = fingerprint(req)
        async with self._namespace_lock(key):  # the lookup and the run: one at a time
            try:
                seen = self.memory.lookup(key, req.request_id, digest)
                if seen is not None:
                    return 200, seen
                resp = await self._run(req, session_header)
            except Exception as e:  # noqa: BLE001 - every failure is an answer
                self.directive_errors += 1
                status, content = error_content(e)
                if status >= 500:
                    log.error("leyline directive failed", error=repr(e))
                return status, content
            resp = resp.model_copy(update={"elapsed_s": time.perf_counter() - t0})
            self._count(resp)
            self.conversations.directive_ran(ns, req)  # what it forgot stays forgotten
            content = resp.model_dump(mode="json")
            self.memory.remember(key, req.request_id, digest, content)
        return 200, content

    async def run_edits(self, req: DirectivesRequest, session: str) -> DirectivesResponse:
        """A message-form directive made by the chat front (``chat_front``: a chat request's
        ``leyline.edits``), checked and run as the directive route runs one, in the
        session's order, and counted; a failure is counted and raised."""
        t0 = time.perf_counter()
        try:
            req = checked(req, await self.limits())
            ns = named_namespace(req.session, session, server_made=True)
            async with self._namespace_lock(salt_for(ns)):
                resp = await self._run(req, session)
        except Exception:
            self.directive_errors += 1
            raise
        resp = resp.model_copy(update={"elapsed_s": time.perf_counter() - t0})
        self._count(resp)
        return resp

    def _count(self, resp: DirectivesResponse) -> None:
        for k, v in resp.splices.items():
            self.splices[k] = self.splices.get(k, 0) + v
        self.rotated_tokens += resp.rotated_tokens
        self.prefilled_tokens += resp.prefilled_tokens
        self.repaired_tokens += resp.repaired_tokens
        self.fallbacks += int(resp.fallback)

    def _namespace_lock(self, key: str) -> asyncio.Lock:
        """Directives of one namespace run one at a time; namespaces run side by side (each
        EngineCore op is atomic, and two namespaces never write the same blocks)."""
        if len(self._locks) > 4096:  # forget idle sessions' locks
            self._locks = {k: v for k, v in self._locks.items() if v.locked()}
        return self._locks.setdefault(key, asyncio.Lock())

    async def _run(self, req: DirectivesRequest, session_header: str | None) -> DirectivesResponse:
        """``req`` through ``directives.pipeline``: compiled, the base looked up in the
        namespace's cache (``cached_prefix``), decided, and the plan executed."""
        # checked by the caller (a client's ids in ``directives``; the chat front's own)
        salt = salt_for(named_namespace(req.session, session_header, server_made=True))
        info = await self.info()
        if info.get("problem"):
            raise RuntimeUnavailableError(f"{info['problem']} (Leyline directives are off)")
        tok = self.engine.get_tokenizer() if hasattr(self.engine, "get_tokenizer") else None
        marker = chat_format(info.get("model_type")).message_boundary
        boundary = token_id(tok, marker) if tok is not None else None
        compiled = compile_request(req, tok, int(info["vocab_size"]), boundary, EXECUTES)
        if isinstance(compiled, TokenForm):
            _check_length(compiled, int(info["max_model_len"]))
        cached = await self.cached_prefix(compiled.base, salt) if compiled.needs_lookup else 0
        decision = decide(compiled, cached, req)
        if isinstance(decision, DirectivesResponse):
            return decision
        if any(rule_of(d.mode, EXECUTES).repairs for d in decision.order):
            workers = info.get("workers") or [{}]
            if workers[0].get("repair_problem"):  # before anything is held or written
                raise RuntimeUnavailableError(workers[0]["repair_problem"])
        return await self._execute(decision, salt)

    async def cached_prefix(self, tokens: list[int], namespace: str) -> int:
        """``directives.backend.PrefixLookup``: the cached length of ``tokens`` under the
        salt ``namespace`` (full blocks and the rows the plugin holds), held by nothing."""
        lock = await self.rpc("lock", tokens=tokens, salt=namespace, hold=False)
        return int(lock["cached_tokens"])

    async def _execute(self, plan: Plan, salt: str) -> DirectivesResponse:
        cur = list(plan.base)
        splices = {"amortize": 0, "forget": 0}
        reused = prefilled = rotated = repaired = 0
        for d in plan.order:  # right to left
            assert isinstance(d.replacement, list)  # compiled by the pipeline
            after = cur[: d.start] + d.replacement + cur[d.end :]
            rule = rule_of(d.mode, EXECUTES)
            if rule.moves_tail:
                # stage: T's rows inside the block holding ``start`` go to the head
                lock = await self.rpc("lock", tokens=cur, salt=salt, stage=d.start)
                c = lock["cached_tokens"]
                if d.end > c and c <= d.start:
                    # An earlier directive of the batch (to the right) left T' cached in full
                    # blocks only: nothing of this span is cached now, the next request
                    # prefills it (the tokens still change).
                    await self.rpc("release", ids=[lock["lock_id"]])
                    cur = after
                    continue
                end = min(d.end, c)  # straddling the cached end: (start, c, R), as clip_to_cached
                hold_id = "head-" + uuid.uuid4().hex
                try:
                    await self.prefill(cur[: d.start] + d.replacement, salt, hold_id)
                    done = await self.rpc(
                        "splice", lock_id=lock["lock_id"], hold_id=hold_id, tokens=cur,
                        start=d.start, end=end, replacement=d.replacement, salt=salt,
                        repair=_repair_of(d) if rule.repairs else None,
                    )  # fmt: skip
                except BaseException:
                    await self.rpc("release", ids=[lock["lock_id"], hold_id])
                    raise
                reused += d.start
                prefilled += d.start + len(d.replacement) - done["head_cached_tokens"]
                rotated += done["rotated_tokens"]
                repaired += done.get("repaired_tokens", 0)
            else:
                # the rows before ``start`` stay: those inside its block are staged for the
                # re-prefill, which computes from ``start`` on
                await self.rpc("forget", tokens=after, start=d.start, salt=salt, stage=cur)
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

    async def flush(self) -> dict[str, Any]:
        """Every pin is dropped and every cached block no request holds is freed
        (``/leyline/v1/flush``, as on ``leyline serve``), and the chat front's conversations
        are forgotten. Counters are untouched."""
        info = await self.info()
        if info.get("problem"):
            raise RuntimeUnavailableError(f"{info['problem']} (Leyline directives are off)")
        done = await self.rpc("flush")
        self.watched.clear()
        return FlushResponse(
            tenant="", flushed_tokens=done["flushed_tokens"], kept_tokens=done["kept_tokens"],
            dropped_pins=done["dropped_pins"],
            dropped_conversations=self.conversations.forget_tenant(DEFAULT_TENANT),
        ).model_dump(mode="json")  # fmt: skip

    async def stats(self) -> dict[str, Any]:
        s = await self.rpc("stats")
        return StatsResponse(
            requests=s["requests"],
            prompt_tokens=s["prompt_tokens"],
            cached_tokens=s["cached_tokens"],
            prefilled_tokens=s["prompt_tokens"] - s["cached_tokens"] + self.prefilled_tokens,
            generated_tokens=s["generated_tokens"],
            splices=dict(self.splices),
            rotated_tokens=self.rotated_tokens,
            repaired_tokens=self.repaired_tokens,
            fallbacks=self.fallbacks,
            directive_errors=self.directive_errors,
            cache_tokens=s["cache_tokens"],
            cache_capacity_tokens=s["cache_capacity_tokens"],
            drift_splices=self.drift_splices,
            drift_unspliced=dict(self.drift_unspliced),
            pinned_tokens=s["pinned_tokens"],
            pin_evictions=s["pin_evictions"],
            features=(BODY_EDITS, CLIENT_EDITS),  # chat_front applies them
        ).model_dump(mode="json")


def _repair_of(d: Directive) -> dict[str, Any]:
    """What the EngineCore's ``splice`` needs to REPAIR ``d``: its budget (the default where
    it gives none) and the selector, those ``leyline serve`` uses by default."""
    budget = DEFAULT_BUDGET if d.budget is None else d.budget
    return {"budget": budget, "selector": DEFAULT_SELECTOR}


def _check_length(compiled: TokenForm, limit: int) -> None:
    """A token-form ``T`` and ``T'`` within ``max_model_len`` (text replacements are only
    counted once tokenized)."""
    if len(compiled.base) > limit:
        raise DirectiveError(f"tokens: {len(compiled.base)} tokens exceed max_model_len {limit}")
    if len(compiled.new_tokens) > limit:
        raise DirectiveError(f"directives: T' has {len(compiled.new_tokens)} tokens > {limit}")


def add_routes(app: Any) -> None:
    """``/leyline/v1/directives``, ``/leyline/v1/stats``, ``/leyline/v1/flush``. Their key
    check, body cap and JSON checks are ``guard.LeylineGuard``'s (in front of every route);
    a route reached without it (a test app) parses its body with the same checks."""

    def route_of(request: Request) -> VLLMRoute:
        route = getattr(request.app.state, "leyline", None)
        if route is None:
            raise RuntimeUnavailableError("the Leyline route has no engine")
        return route

    async def answer(request: Request, work: Any) -> JSONResponse:
        try:
            status, content = await work(route_of(request))
        except Exception as e:  # noqa: BLE001 - every failure is an answer
            status, content = error_content(e)
            if status >= 500:
                log.error("leyline route failed", path=request.url.path, error=repr(e))
        return JSONResponse(content, status_code=status)

    async def body_of(request: Request) -> Any:
        if BODY_KEY in request.scope:
            return request.scope[BODY_KEY]
        raw = await request.body()
        return http_guards.parse_json(raw) if raw.strip() else None

    async def directives(request: Request) -> JSONResponse:
        async def work(route: VLLMRoute) -> tuple[int, dict[str, Any]]:
            try:
                body = await body_of(request)
            except http_guards.GuardError:
                route.directive_errors += 1
                raise
            return await route.directives(body, request.headers.get(SESSION_HEADER))

        return await answer(request, work)

    async def stats(request: Request) -> JSONResponse:
        async def work(route: VLLMRoute) -> tuple[int, dict[str, Any]]:
            return 200, await route.stats()

        return await answer(request, work)

    async def flush(request: Request) -> JSONResponse:
        async def work(route: VLLMRoute) -> tuple[int, dict[str, Any]]:
            body = await body_of(request)
            if body not in (None, {}):
                raise http_guards.GuardError(
                    "this route takes no fields; send no body or {}", "body"
                )
            return 200, await route.flush()

        return await answer(request, work)

    app.add_api_route("/leyline/v1/directives", directives, methods=["POST"])
    app.add_api_route("/leyline/v1/stats", stats, methods=["GET"])
    app.add_api_route("/leyline/v1/flush", flush, methods=["POST"])
