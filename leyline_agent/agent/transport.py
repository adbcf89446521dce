"""``LeylineTransport``: the wrapper as an httpx transport, where every SDK call passes.

    t = LeylineTransport(policies=["stale-tool"])
    client = openai.OpenAI(base_url=..., http_client=httpx.Client(transport=t))
    aclient = openai.AsyncOpenAI(base_url=..., http_client=httpx.AsyncClient(transport=t))

One object is both an ``httpx.BaseTransport`` and an ``httpx.AsyncBaseTransport`` (the same
sessions behind a sync and an async client: LangChain's ``http_client`` and
``http_async_client``). Because it sits below the SDK, the SDK's copies (``with_options``,
``copy``), ``with_raw_response`` and ``with_streaming_response`` keep it, and every reply is
observed: the body passes through unchanged and is read as it goes (JSON or server-sent
events). Other requests than ``POST .../chat/completions`` and ``POST .../responses`` pass
through untouched.

For a chat request it does what ``wrap_openai`` does, with the same ``ContextSession``:
run the policies on the body's ``messages``, send the edited body with ``X-Leyline-Session``
and this turn's edits of cached messages in the body itself (``{"leyline": {"client_edits":
mode, "edits": [...]}}``: the server splices them in the turn's own job, before its prefill;
no separate directive request), and record the reply. Whether the server is Leyline's is
detected once per server root (``GET /leyline/v1/stats`` through an ``HTTPRuntime``, bearer
key from the request's ``Authorization``); a plain endpoint gets no ``leyline`` field.
A framework's own in-place edits of its history keep the session and ride along the same
way, so ``LeylineTransport([])`` (no policies) names sessions and passes those edits on.
``runtime=`` a ``Runtime`` object: explicit use, edits go to it as directives and the body
says ``{"leyline": {"client_edits": "off"}}`` (the server must not splice them again).

Both HTTP libraries: a request of ``httpx`` or of ``httpx2`` (the OpenAI SDK's and
pydantic-ai's newer one) is forwarded to a default transport of its own library (or to
``transport=`` / ``async_transport=``), rebuilt and observed with that library's classes.

Sessions: a request that names one (its ``X-Leyline-Session`` header, the body's
``leyline_session`` key, removed before sending, or the transport's ``session_id=``) gets
that one. Otherwise the session is found by content: the longest known conversation whose
last turn the request repeats (preferring one whose observed reply it echoes), not counting
sessions with a call in flight; none -> a new session. So concurrent runs on one client get
their own sessions and their own directives. The sessions live in a
``registry.SessionRegistry`` (``wrap_openai``'s too), which keeps a bounded number of them.

A Responses request (the OpenAI Agents SDK's default model, ``OpenAIResponsesModel``) is
read as the chat messages it stands for (``instructions`` as the system message at the head,
then its ``input`` items, ``responses_items``), the policies run on those, and their edits
are written back into the items (a tool result's ``output``, a message's text, a call's
arguments); the edits ride in the body as on chat (the server serves Responses through its
chat route). One the transport cannot read that way (a ``previous_response_id``, whose
history only the server has; an item type it does not know) goes through as the SDK built
it, counted in ``failures`` and logged.

Failures of the middleware (a policy error, an unreadable body) are logged and counted and
the request goes through as the SDK built it; ``strict=True`` raises them.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import httpx

try:  # the OpenAI SDK's newer HTTP library; optional
    import httpx2
except ImportError:  # pragma: no cover - httpx alone
    httpx2 = None

from leyline_agent.agent.http_runtime import AuthenticationError, HTTPRuntime, server_root
from leyline_agent.agent.registry import SessionRegistry
from leyline_agent.agent.session import ContextSession
from leyline_agent.agent.stream_observer import ReplyAssembler
from leyline_agent.directives import Mode
from leyline_agent.errors import LeylineError, RuntimeUnavailableError
from leyline_agent.logs import get_logger
from leyline_agent.namespaces import SESSION_HEADER
from leyline_agent.protocols import Runtime
from leyline_agent.responses_items import edited_items, reply_message, responses_messages

__all__ = ["LeylineTransport"]

log = get_logger(__name__)  # silent until configured (leyline_agent.logs)

SESSION_KEY = "leyline_session"
CHAT_PATH = "/chat/completions"
RESPONSES_PATH = "/responses"
_LIBS: tuple[ModuleType, ...] = (httpx,) if httpx2 is None else (httpx, httpx2)
_TRANSPORTS = tuple(c for lib in _LIBS for c in (lib.BaseTransport, lib.AsyncBaseTransport))
_STREAMS = tuple(c for lib in _LIBS for c in (lib.SyncByteStream, lib.AsyncByteStream))


def _root(request: Any) -> str:
    """The server a chat request goes to (its URL before ``/chat/completions``, no ``/v1``)."""
    return server_root(str(request.url).split(CHAT_PATH)[0])


def _lib(request: Any) -> ModuleType:
    """The HTTP library (``httpx`` or ``httpx2``) a request object belongs to."""
    lib = sys.modules.get(type(request).__module__.split(".")[0])
    return lib if lib in _LIBS else httpx


@dataclass(slots=True)
class _Exchange:
    """One chat call in flight: its session, and how to record its reply."""

    session: ContextSession
    stream: bool
    done: Callable[[], None] = field(default=lambda: None)
    responses: bool = False  # a Responses call: its reply is a Response


class LeylineTransport(*_TRANSPORTS):  # type: ignore[misc]  # httpx's and httpx2's bases
    def __init__(
        self,
        policies: Sequence[Any] = ("stale-tool",),
        *,
        runtime: Runtime | str | None = None,
        session_id: str | None = None,
        mode: Mode = Mode.AMORTIZE,
        strict: bool = False,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        from leyline_agent.agent.wrappers import client_session_id
        from leyline_agent.policies import load_policy

        self.policies = [load_policy(p, where=f"policies[{k}]") for k, p in enumerate(policies)]
        self.mode = Mode(mode)
        self.strict = strict
        self.session_id = client_session_id(session_id, "session_id")
        if not (runtime is None or runtime in ("auto", "off") or isinstance(runtime, Runtime)):
            raise LeylineError(
                f"runtime: expected a Runtime, 'auto', 'off' or None, got {runtime!r}"
            )
        self._runtime_spec = runtime
        self._runtimes: dict[str, Any] = {}  # server root -> runtime (None: plain endpoint)
        self._registry = SessionRegistry(self._new_session)
        self._lock = threading.Lock()
        self._transport = transport
        self._async_transport = async_transport
        self._defaults: dict[tuple[str, bool], Any] = {}  # (library, async) -> its transport
        self.failures = 0  # middleware failures let through

    # -- public state -------------------------------------------------------------------------
    @property
    def sessions(self) -> list[ContextSession]:
        """Every session kept (a snapshot), named ones first."""
        return self._registry.sessions()

    # -- httpx ---------------------------------------------------------------------------------
    def _inner(self, request: Any, is_async: bool) -> Any:
        given = self._async_transport if is_async else self._transport
        if given is not None:
            return given
        lib = _lib(request)
        key = (lib.__name__, is_async)
        with self._lock:
            if key not in self._defaults:
                cls = lib.AsyncHTTPTransport if is_async else lib.HTTPTransport
                self._defaults[key] = cls()
            return self._defaults[key]

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        inner = self._inner(request, is_async=False)
        request, ex = self._before(request)
        try:
            response = inner.handle_request(request)
        except BaseException:
            self._release(ex)
            raise
        return self._after(ex, response)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        inner = self._inner(request, is_async=True)
        if _is_chat(request) or _is_responses(request):
            await request.aread()
            request, ex = await asyncio.to_thread(self._before, request)  # runtime I/O is sync
        else:
            ex = None
        try:
            response = await inner.handle_async_request(request)
        except BaseException:
            self._release(ex)
            raise
        return self._after(ex, response)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        for (_, is_async), t in list(self._defaults.items()):
            if not is_async:
                t.close()
        for rt in self._runtimes.values():
            if rt is not None and hasattr(rt, "close") and self._runtime_spec in (None, "auto"):
                rt.close()

    async def aclose(self) -> None:
        if self._async_transport is not None:
            await self._async_transport.aclose()
        for (_, is_async), t in list(self._defaults.items()):
            if is_async:
                await t.aclose()

    # -- around one call (shared by sync and async) ---------------------------------------------
    def _before(self, request: httpx.Request) -> tuple[httpx.Request, _Exchange | None]:
        responses = _is_responses(request)
        if not (responses or _is_chat(request)):
            return request, None
        try:
            body = json.loads(request.read())
            if not isinstance(body, dict):
                return request, None
            if responses:
                messages, tools, head = responses_messages(body)
            elif isinstance(body.get("messages"), list):
                messages, tools, head = body["messages"], body.get("tools"), 0
            else:
                return request, None
            session = self._session(request, body, messages)
            root = _root(request)
        except Exception as e:  # noqa: BLE001 - an unreadable body is the server's to refuse
            if self.strict or isinstance(e, LeylineError):
                raise
            self.failures += 1
            log.warning("leyline_transport.unreadable", error=f"{type(e).__name__}: {e}")
            return request, None
        from leyline_agent.agent.wrappers import rides_in_body, with_leyline_field

        session.runtime = self._runtime(root, request)
        rides = rides_in_body(session.runtime) and self._runtime_spec in (None, "auto")
        args = (
            messages,
            tools if isinstance(tools, list) else None,
            body.get("model") if isinstance(body.get("model"), str) else None,
        )
        try:
            if rides:  # the edits go in the body: no directive request
                plan = session.plan(*args)
                sent = plan.messages_to_send
                with_leyline_field(body, "leyline", session.leyline_field(plan))
            else:
                sent = session.prepare(*args)
            if not responses:
                body["messages"] = sent
            elif sent[:head] != messages[:head]:
                raise ValueError("a policy edited the instructions")
            elif sent[head:] != messages[head:]:  # the edits written back into the items
                body["input"] = edited_items(body["input"], messages[head:], sent[head:])
        except Exception as e:  # noqa: BLE001 - let the user's call through
            if self.strict:
                self._release(_Exchange(session, False))
                raise
            self.failures += 1
            session.reset()
            log.warning(
                "leyline_transport.policies_failed", session=session.session_id, error=str(e)
            )
        if not rides and session.runtime is not None and self.policies:  # sent as directives
            body.setdefault("leyline", {"client_edits": "off"})
        lib = _lib(request)
        headers = lib.Headers(request.headers)
        headers.pop("content-length", None)
        headers[SESSION_HEADER] = session.session_id
        out = lib.Request(
            request.method,
            request.url,
            headers=headers,
            content=json.dumps(body).encode(),
            extensions=request.extensions,
        )
        return out, _Exchange(session, body.get("stream") is True, responses=responses)

    def _after(self, ex: _Exchange | None, response: httpx.Response) -> httpx.Response:
        if ex is None:
            return response
        if response.status_code != 200:
            self._release(ex)
            return response
        session = ex.session

        def on_body(raw: bytes | None) -> None:
            try:
                if raw is not None:
                    reply = _reply(raw, response, ex.stream, ex.responses)
                    if reply is not None:
                        session.observe_reply(reply)
            except Exception as e:  # noqa: BLE001 - observing must not break the call
                log.warning("leyline_transport.observe_failed", error=f"{type(e).__name__}: {e}")
            finally:
                self._release(ex)

        response.stream = _ObservedBody(response.stream, on_body)
        return response

    def _release(self, ex: _Exchange | None) -> None:
        if ex is not None:
            self._registry.release(ex.session)

    # -- sessions -------------------------------------------------------------------------------
    def _session(
        self, request: httpx.Request, body: dict[str, Any], messages: list[dict[str, Any]]
    ) -> ContextSession:
        """The session of this request (marked busy): named, or found by content, or new."""
        from leyline_agent.agent.wrappers import client_session_id

        sid = asked = None
        if SESSION_KEY in body:
            sid = asked = client_session_id(body.pop(SESSION_KEY), f"body.{SESSION_KEY}")
        header = request.headers.get(SESSION_HEADER)
        if header is not None:
            sid = client_session_id(header, f"headers[{SESSION_HEADER!r}]")
            if asked is not None and sid != asked:
                raise LeylineError(f"{SESSION_HEADER} {sid!r} contradicts {SESSION_KEY} {asked!r}")
        sid = sid or self.session_id
        root = _root(request)
        if sid is not None:
            return self._registry.named(sid, root, busy=True)
        return self._registry.by_content(messages, root)

    def _new_session(self, sid: str) -> ContextSession:
        return ContextSession(
            self.policies, None, mode=self.mode, session_id=sid, fallback=not self.strict
        )

    # -- runtime (detected once per server root) -------------------------------------------------
    def _runtime(self, root: str, request: httpx.Request) -> Any:
        spec = self._runtime_spec
        if spec == "off":
            return None
        if spec not in (None, "auto"):
            return spec
        with self._lock:
            if root in self._runtimes:
                return self._runtimes[root]
        auth = request.headers.get("authorization", "")
        key = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        rt = HTTPRuntime(root, api_key=key)
        try:
            has: bool | None = rt.has_leyline()
        except (RuntimeUnavailableError, AuthenticationError) as e:
            log.warning("leyline_transport.runtime_unreachable", root=root, error=str(e))
            has = None
        if has is None:
            rt.close()
            return None  # unreachable: ask again next call
        if not has:
            log.info("leyline_transport.plain_endpoint", root=root)
        with self._lock:
            self._runtimes.setdefault(root, rt if has else None)
            return self._runtimes[root]


def _is_chat(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.rstrip("/").endswith(CHAT_PATH)


def _is_responses(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.rstrip("/").endswith(RESPONSES_PATH)


def _reply(
    raw: bytes, response: Any, stream: bool, responses: bool = False
) -> dict[str, Any] | None:
    """The assistant message of choice 0 in a reply body (JSON, or server-sent events); of a
    Response's output items for a Responses call."""
    headers = response.headers
    enc = headers.get("content-encoding")
    if enc and enc != "identity":  # decode as the response's own library would
        lib = _lib(response)
        raw = lib.Response(200, headers={"content-encoding": enc}, content=raw).content
    text = raw.decode("utf-8", errors="replace")
    if responses:
        return _response_reply(text, stream)
    if not stream and "text/event-stream" not in headers.get("content-type", ""):
        choices = json.loads(text).get("choices") or []
        return choices[0].get("message") if choices else None
    asm = ReplyAssembler()
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[len("data:") :].strip()
            if data and data != "[DONE]":
                asm.add(json.loads(data))
    return asm.message()


def _response_reply(text: str, stream: bool) -> dict[str, Any] | None:
    """The assistant message of a Response (JSON) or of its stream's last event."""
    if not stream:
        return reply_message(json.loads(text).get("output") or [])
    for line in reversed(text.splitlines()):
        if line.startswith("data:"):
            event = json.loads(line[len("data:") :].strip() or "{}")
            if event.get("type") in ("response.completed", "response.incomplete"):
                return reply_message(event["response"].get("output") or [])
    return None


class _ObservedBody(*_STREAMS):  # type: ignore[misc]  # httpx's and httpx2's stream bases
    """A response body passed through as it is read; ``on_body(all bytes)`` once it has been
    read to its end, ``on_body(None)`` if it is closed before that."""

    def __init__(self, inner: Any, on_body: Callable[[bytes | None], None]) -> None:
        self._inner = inner
        self._on_body = on_body
        self._parts: list[bytes] = []
        self._ended = False

    def _end(self, raw: bytes | None) -> None:
        if not self._ended:
            self._ended = True
            self._on_body(raw)

    def __iter__(self) -> Iterator[bytes]:
        for part in self._inner:
            self._parts.append(part)
            yield part
        self._end(b"".join(self._parts))

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._inner:
            self._parts.append(part)
            yield part
        self._end(b"".join(self._parts))

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._end(None)

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self._end(None)
