"""API-server side: ``POST /leyline/v1/directives``, ``GET /leyline/v1/stats`` and the
``X-Leyline-Session`` middleware, as a ``vllm.endpoint_plugins`` plugin.

Execution of one AMORTIZE ``(s, e, R)`` on ``T`` (directives run right to left, each on the
sequence the previous one left), all calls in the directive's namespace (its salt):

1. ``lock`` (EngineCore): ``T``'s cached full blocks, held; a span past them is a
   ``CacheMissError`` (409, or ``fallback``) and nothing was held or changed;
2. the head ``T[:s] + R`` as an ordinary vLLM request (one greedy token) through
   ``engine_client.generate``: vLLM's own prefill computes ``R`` over the cached prefix; its
   blocks are held when it finishes (``scheduler.HOLD_KEY``);
3. ``splice`` (EngineCore): the tail re-packed into fresh blocks with its keys rotated by
   ``delta`` on every worker, ``T'`` registered in the prefix cache.

FORGET ``(s, e, R)``: ``forget`` drops the namespace's cached blocks of ``T'`` from the block
holding ``s`` on, then ``T'`` is an ordinary request. Everything that can be checked
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
from pydantic import ValidationError

from leyline_agent.directives import Directive, Mode, plan_batch, splice_tokens
from leyline_agent.directives.compile import (
    clip_to_cached,
    message_edits,
    to_directives,
    token_form,
)
from leyline_agent.errors import CacheMissError, DirectiveError, RuntimeUnavailableError
from leyline_agent.families import chat_format, token_id
from leyline_agent.namespaces import SESSION_HEADER, Namespace, check_session_id, named_namespace
from leyline_agent.vllm_plugin.errors import ModelNotFoundError, error_content
from leyline_agent.vllm_plugin.namespace import salt_for
from leyline_agent.vllm_plugin.scheduler import HOLD_KEY
from leyline_agent.wire import DirectivesRequest, DirectivesResponse, StatsResponse

__all__ = ["LeylineRoute", "SessionSaltMiddleware", "add_routes"]

log = structlog.get_logger(__name__)
_ERROR_TYPES = {
    "CacheMissError": CacheMissError,
    "DirectiveError": DirectiveError,
    "RuntimeUnavailableError": RuntimeUnavailableError,
}
_MEMORY = 1024  # request ids remembered for idempotent retries


class LeylineRoute:
    def __init__(self, engine_client: Any, model_names: list[str]) -> None:
        self.engine = engine_client
        self.model_names = model_names
        self.splices = {"amortize": 0, "forget": 0}
        self.rotated_tokens = 0
        self.prefilled_tokens = 0
        self.fallbacks = 0
        self.directive_errors = 0
        self._locks: dict[str, asyncio.Lock] = {}  # one per namespace (salt)
        self._info: dict[str, Any] | None = None
        self._answers: OrderedDict[str, dict[str, Any]] = OrderedDict()

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

    # -- the directive route ---------------------------------------------------------------
    async def directives(self, body: Any, session_header: str | None) -> tuple[int, dict[str, Any]]:
        try:
            req = DirectivesRequest.model_validate(body)
        except ValidationError as e:
            self.directive_errors += 1
            return error_content(e)
        if req.request_id is not None and req.request_id in self._answers:
            return 200, self._answers[req.request_id]
        t0 = time.perf_counter()
        try:
            key = salt_for(named_namespace(req.session, session_header))
        except Exception as e:  # noqa: BLE001 - a bad session id is an answer too
            self.directive_errors += 1
            return error_content(e)
        async with self._namespace_lock(key):
            try:
                resp = await self._run(req, session_header)
            except Exception as e:  # noqa: BLE001 - every failure is an answer
                self.directive_errors += 1
                status, content = error_content(e)
                if status >= 500:
                    log.error("leyline directive failed", error=repr(e))
                return status, content
        resp = resp.model_copy(update={"elapsed_s": time.perf_counter() - t0})
        for k, v in resp.splices.items():
            self.splices[k] = self.splices.get(k, 0) + v
        self.rotated_tokens += resp.rotated_tokens
        self.prefilled_tokens += resp.prefilled_tokens
        self.fallbacks += int(resp.fallback)
        content = resp.model_dump(mode="json")
        if req.request_id is not None:
            self._answers[req.request_id] = content
            while len(self._answers) > _MEMORY:
                self._answers.popitem(last=False)
        return 200, content

    def _namespace_lock(self, key: str) -> asyncio.Lock:
        """Directives of one namespace run one at a time; namespaces run side by side (each
        EngineCore op is atomic, and two namespaces never write the same blocks)."""
        if len(self._locks) > 4096:  # forget idle sessions' locks
            self._locks = {k: v for k, v in self._locks.items() if v.locked()}
        return self._locks.setdefault(key, asyncio.Lock())

    async def _run(self, req: DirectivesRequest, session_header: str | None) -> DirectivesResponse:
        ns = named_namespace(req.session, session_header)
        salt = salt_for(ns)
        if req.model is not None and req.model not in self.model_names:
            raise ModelNotFoundError(
                f"model: {req.model!r} is not served here (served: {', '.join(self.model_names)})"
            )
        info = await self.info()
        if info.get("problem"):
            raise RuntimeUnavailableError(f"{info['problem']} (Leyline directives are off)")
        tok = self.engine.get_tokenizer() if hasattr(self.engine, "get_tokenizer") else None
        limit = int(info["max_model_len"])
        if req.tokens is not None and req.directives is not None:
            tokens, directives = token_form(
                req.tokens, req.directives, tok, int(info["vocab_size"])
            )
            if len(tokens) > limit:
                raise DirectiveError(f"tokens: {len(tokens)} tokens exceed max_model_len {limit}")
            order = plan_batch(directives, seq_len=len(tokens))
            new_tokens = splice_tokens(tokens, order)
            if len(new_tokens) > limit:
                raise DirectiveError(f"directives: T' has {len(new_tokens)} tokens > {limit}")
            lock = await self.rpc("lock", tokens=tokens, salt=salt)
            cached = lock["cached_tokens"]
            await self.rpc("release", ids=[lock["lock_id"]])
            for i, d in enumerate(directives):
                if d.end > cached or cached == 0:
                    return self._miss(
                        req, new_tokens, order, cached,
                        f"directives[{i}]: span [{d.start}, {d.end}) of 'tokens' is not cached "
                        f"(the prefix cache holds its first {cached} of {len(tokens)} tokens)",
                    )  # fmt: skip
        else:
            boundary = token_id(tok, chat_format(info.get("model_type")).message_boundary)
            edits = message_edits(
                tok, list(req.old_messages or []), list(req.new_messages or []), req.tools, boundary
            )
            old, new_tokens, spans = edits.old, edits.new, edits.spans
            if not spans:
                return DirectivesResponse(outcome="noop", tokens=new_tokens, applied=[])
            lock = await self.rpc("lock", tokens=old, salt=salt)
            cached = lock["cached_tokens"]
            await self.rpc("release", ids=[lock["lock_id"]])
            kept = clip_to_cached(spans, cached)
            if cached == 0 or not kept:
                return self._miss(
                    req, new_tokens, [], cached,
                    f"old_messages: the edits start at token {spans[0].start} but only the "
                    f"first {cached} tokens of the rendered conversation are cached",
                )  # fmt: skip
            order = plan_batch(to_directives(kept, req.mode), seq_len=cached)
            tokens = old[:cached]
        return await self._execute(tokens, order, salt, new_tokens, cached)

    def _miss(self, req, new_tokens, order, cached, message) -> DirectivesResponse:  # noqa: ANN001
        if not req.fallback:
            raise CacheMissError(message)
        return DirectivesResponse(
            outcome="fallback", tokens=new_tokens, applied=order, splices={}, fallback=True,
            cached_base_tokens=cached,
        )  # fmt: skip

    async def _execute(
        self, tokens: list[int], order: list[Directive], salt: str, final: list[int], cached: int
    ) -> DirectivesResponse:
        cur = list(tokens)
        splices = {"amortize": 0, "forget": 0}
        reused = prefilled = rotated = 0
        for d in order:  # right to left
            assert isinstance(d.replacement, list)  # compiled above
            after = cur[: d.start] + d.replacement + cur[d.end :]
            if d.mode is Mode.AMORTIZE:
                lock = await self.rpc("lock", tokens=cur, salt=salt)
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
                    )  # fmt: skip
                except BaseException:
                    await self.rpc("release", ids=[lock["lock_id"], hold_id])
                    raise
                reused += d.start
                prefilled += d.start + len(d.replacement) - done["head_cached_tokens"]
                rotated += done["rotated_tokens"]
            else:
                await self.rpc("forget", tokens=after, start=d.start, salt=salt)
                await self.prefill(after, salt)
                reused += d.start
                prefilled += len(after) - d.start
            splices[d.mode.value] += 1
            cur = after
        return DirectivesResponse(
            outcome="applied" if order else "noop", tokens=final, applied=order, splices=splices,
            cached_base_tokens=cached, reused_tokens=reused, prefilled_tokens=prefilled,
            rotated_tokens=rotated,
        )  # fmt: skip

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
            fallbacks=self.fallbacks,
            directive_errors=self.directive_errors,
            cache_tokens=s["cache_tokens"],
            cache_capacity_tokens=s["cache_capacity_tokens"],
        ).model_dump(mode="json")


def add_routes(app: Any) -> None:
    def route_of(request: Request) -> LeylineRoute | None:
        return getattr(request.app.state, "leyline", None)

    async def directives(request: Request) -> JSONResponse:
        route = route_of(request)
        if route is None:
            status, content = error_content(
                RuntimeUnavailableError("the Leyline route has no engine")
            )
            return JSONResponse(content, status_code=status)
        try:
            body = await request.json()
        except ValueError:
            route.directive_errors += 1
            status, content = error_content(DirectiveError("body: not valid JSON"))
            return JSONResponse(content, status_code=422 if status == 400 else status)
        status, content = await route.directives(body, request.headers.get(SESSION_HEADER))
        return JSONResponse(content, status_code=status)

    async def stats(request: Request) -> JSONResponse:
        route = route_of(request)
        try:
            if route is None:
                raise RuntimeUnavailableError("the Leyline route has no engine")
            return JSONResponse(await route.stats())
        except Exception as e:  # noqa: BLE001
            status, content = error_content(e)
            return JSONResponse(content, status_code=status)

    app.add_api_route("/leyline/v1/directives", directives, methods=["POST"])
    app.add_api_route("/leyline/v1/stats", stats, methods=["GET"])


_SALTED_PATHS = ("/v1/chat/completions", "/v1/completions")


class SessionSaltMiddleware:
    """Pure ASGI: a completion request with ``X-Leyline-Session: id`` gets
    ``cache_salt = salt_for(Namespace(session=id))`` in its JSON body, so vLLM serves it from
    that session's namespace (the scheduler then routes it, ``namespace.route_salt``). A bad
    id, or a body ``cache_salt`` of its own next to the header, is a 400 naming the field."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in _SALTED_PATHS
        ):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        raw = headers.get(SESSION_HEADER.lower())
        if raw is None:
            await self.app(scope, receive, send)
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        try:
            sid = check_session_id(raw.decode("utf-8", "replace"), SESSION_HEADER)
            data = json.loads(body) if body else None
            if isinstance(data, dict):
                salt = salt_for(Namespace(session=sid))
                if data.get("cache_salt") not in (None, salt):
                    raise DirectiveError(
                        f"cache_salt: cannot be combined with the {SESSION_HEADER} header "
                        "(the session's blocks live under its own salt)"
                    )
                data["cache_salt"] = salt
                body = json.dumps(data).encode()
        except ValueError as e:  # includes DirectiveError and bad JSON (vLLM answers that)
            if isinstance(e, json.JSONDecodeError):
                pass
            else:
                from starlette.responses import JSONResponse

                status, content = error_content(
                    e if isinstance(e, DirectiveError) else DirectiveError(str(e))
                )
                await JSONResponse(content, status_code=status)(scope, receive, send)
                return
        new_headers = [
            (k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"
        ] + [(b"content-length", str(len(body)).encode())]
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": new_headers}, replay, send)
