"""``LeylineGuard``: the pure ASGI middleware the plugin puts in front of vLLM's app.

vLLM checks ``--api-key`` only on its own path prefixes (``/v1``, ``/v2``, ...), and reads
``cache_salt`` from a client's body as it is. So, with the shared checks of
``leyline_agent.http.guards`` (the ones ``leyline serve`` runs, same answers):

- **Leyline routes** (``/leyline/...``): with an API key set (``--api-key`` or
  ``VLLM_API_KEY``), 401 without it (constant-time compare); a body over the limit is a 413
  (by ``Content-Length`` before a byte is read, else as soon as the count passes it); the
  body is parsed here (not JSON, deeper than ``MAX_JSON_DEPTH``, a lone surrogate or a
  non-finite number: a 400 naming the field) and handed to the route in the scope
  (``BODY_KEY``), so the route never parses it again.
- **Every other POST with a JSON body** (chat, completions, responses, ...): a body over
  the limit is a 413 (the middleware holds the body to read its ``cache_salt``). A client's
  own ``cache_salt`` starting with ``leyline-`` is refused (400 naming ``cache_salt``):
  such salts are Leyline's session namespaces, which the scheduler routes
  (``namespace.route_salt``); a client's salt there would be moved to the shared unsalted
  pool and served other clients' rows. With ``X-Leyline-Session: id`` the request gets that
  session's salt (a bad id, or a ``cache_salt`` of its own next to the header: 400).
- **Chat requests** (``/v1/chat/completions``) go through ``front.chat_proxy``, the Leyline
  front ``leyline serve`` runs (``front.chat_turn``): the request's conversation is found, its
  ``context_management``, declared ``leyline.edits``, client edits and drift are spliced
  before vLLM sees it, the answer says what came of them, and its reply is read as it passes
  (``front.replies``) to record the conversation. ``leyline`` and ``context_management`` outside a
  chat request are a 400 naming the field, and so is a request that asks for them beside a
  ``cache_salt`` of the client's own (its rows are the client's private namespace; without
  such a field that request is served untracked). A body that is not JSON is passed on
  unchanged (vLLM answers it). A request without a valid key on a path vLLM guards is
  passed on unread: vLLM answers its 401.
- **Anthropic's Messages API** (``/v1/messages``, ``/v1/messages/count_tokens``) is served
  by the Leyline front (``front.messages_proxy``), not vLLM's own Anthropic routes: a message request
  goes on as the chat request it becomes, through the chat handling above.
- **``GET /metrics``**: vLLM's own series, then Leyline's (``leyline_agent.metrics``: the
  counters of ``/leyline/v1/stats`` and the chat turns' splices by source).

The limit is ``LEYLINE_MAX_BODY_BYTES`` (bytes; default 16 MiB, ``leyline serve``'s).
"""

from __future__ import annotations

import json
import os
from argparse import Namespace as Args
from typing import TYPE_CHECKING

from leyline_agent.directives.answers import error_content
from leyline_agent.errors import LeylineError, RuntimeUnavailableError
from leyline_agent.front.chat_proxy import ChatFront, check_fields
from leyline_agent.front.messages_proxy import (
    COUNT_PATH,
    MESSAGES_PATH,
    count_tokens,
    messages_request,
    translating,
)
from leyline_agent.front.replies import reading
from leyline_agent.http import guards
from leyline_agent.http.asgi import (
    ASGIApp,
    Receive,
    Scope,
    Send,
    annotating,
    appending,
    header,
    send_json,
    with_body,
)
from leyline_agent.http.guards import GuardError
from leyline_agent.metrics import SpliceSources, stats_text
from leyline_agent.namespaces import SESSION_HEADER, Namespace, check_session_id
from leyline_agent.vllm_plugin.namespace import is_leyline_salt, salt_for
from leyline_agent.wire import StatsResponse

if TYPE_CHECKING:
    from starlette.datastructures import State

__all__ = ["BODY_KEY", "FRONT_STATE", "KEYS_STATE", "LeylineGuard", "api_keys"]

BODY_KEY = "leyline.body"  # the scope key of a Leyline route's parsed body
KEYS_STATE = "leyline_api_keys"  # app.state: the key digests (set by init_state)
FRONT_STATE = "leyline_chat"  # app.state: the ``front.chat_proxy.ChatFront`` (set by init_state)
SOURCES_STATE = "leyline_splice_sources"  # app.state: ``metrics.SpliceSources``
METRICS_PATH = "/metrics"
CHAT_PATH = "/v1/chat/completions"
LEYLINE_PREFIX = "/leyline"
VLLM_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's AuthenticationMiddleware
_FORMS = (b"multipart/form-data", b"application/x-www-form-urlencoded")


def api_keys(args: Args | None) -> tuple[bytes, ...]:
    """The keys vLLM itself checks: ``--api-key`` (repeatable) over ``VLLM_API_KEY``."""
    given: str | list[str] | None = getattr(args, "api_key", None)
    keys = [given] if isinstance(given, str) else list(given or [])
    return guards.key_digests(k for k in keys or [os.environ.get("VLLM_API_KEY", "")] if k)


def _state(scope: Scope) -> State | None:
    """vLLM's ``app.state`` (None before the app is set in the scope)."""
    return getattr(scope.get("app"), "state", None)


class LeylineGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.limit = guards.max_body_bytes()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        try:
            if path == LEYLINE_PREFIX or path.startswith(LEYLINE_PREFIX + "/"):
                await self._leyline(scope, receive, send)
            elif path in (MESSAGES_PATH, COUNT_PATH) and scope.get("method") == "POST":
                await self._messages(scope, receive, send, path)
            elif path == METRICS_PATH and scope.get("method") == "GET":
                await self._metrics(scope, receive, send)
            else:
                await self._other(scope, receive, send, path)
        except GuardError as e:
            await guards.send_error(send, e)
        except LeylineError as e:  # the chat front's refusals and failures
            await send_json(send, *error_content(e))

    def _keys(self, scope: Scope) -> tuple[bytes, ...] | None:
        return getattr(_state(scope), KEYS_STATE, None)

    def _authorized(self, scope: Scope) -> bool:
        keys = self._keys(scope)
        auth = header(scope.get("headers", ()), b"authorization")
        return not keys or guards.bearer_problem(auth, keys) is None

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        return await guards.read_capped(scope.get("headers", ()), receive, self.limit)

    async def _leyline(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self._keys(scope)
        if keys is None:  # before init_state: the environment's key, as vLLM has it
            keys = api_keys(None)
        if keys:
            auth = header(scope.get("headers", ()), b"authorization")
            problem = guards.bearer_problem(auth, keys)
            if problem is not None:
                raise guards.authentication_error(problem)
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        raw = await self._body(scope, receive)
        scope[BODY_KEY] = guards.parse_json(raw) if raw.strip() else None
        await self.app(scope, guards.replay(raw, receive), send)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's ``/metrics`` with Leyline's series after its own (``metrics.stats_text``)."""
        route = getattr(_state(scope), "leyline", None)
        if route is None:
            await self.app(scope, receive, send)
            return
        stats = StatsResponse.model_validate(await route.stats())
        extra = stats_text(stats, _sources(scope).snapshot())
        await self.app(scope, receive, appending(send, extra))

    async def _messages(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """Anthropic's Messages API as a chat request through ``_other``
        (``front.messages_proxy``)."""
        if not self._authorized(scope):
            await self.app(scope, receive, send)  # vLLM answers its own 401
            return
        raw = await self._body(scope, receive)
        if path == COUNT_PATH:
            await send_json(send, 200, await count_tokens(_front(scope), raw))
            return
        req, body = messages_request(raw)
        chat = {**with_body(scope, body), "path": CHAT_PATH, "raw_path": CHAT_PATH.encode()}
        out = translating(send, req)
        await self._other(chat, guards.replay(body, receive), out, CHAT_PATH)

    async def _other(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        ctype = (header(scope.get("headers", ()), b"content-type") or b"").lower()
        if scope.get("method") != "POST" or ctype.startswith(_FORMS):
            await self.app(scope, receive, send)
            return
        if path.startswith(VLLM_GUARDED) and not self._authorized(scope):
            await self.app(scope, receive, send)  # vLLM answers its own 401
            return
        raw = await self._body(scope, receive)
        data = _json_object(raw)
        sid = _session(header(scope.get("headers", ()), SESSION_HEADER.lower().encode()))
        chat = path == CHAT_PATH
        front = _front_of(scope) if chat else None
        own_salt = data is not None and _own_salt(data.get("cache_salt"))
        # an anonymous chat request is tracked when the front's mode is on, as on leyline
        # serve; one with a salt of its own stays in its private namespace, untracked
        tracked = front is not None and front.mode != "off" and not own_salt
        if data is None or (sid is None and not _for_leyline(data) and not tracked):
            await self.app(scope, guards.replay(raw, receive), send)  # nothing to do here
            return
        check_fields(data, chat=chat, own_salt=own_salt)
        _salt(data, sid)  # checked before anything is spliced
        out = send
        if chat:
            done = await _front(scope).splice(data, sid)  # the turn's edits and drift
            data = done.body
            if done.namespace is not None:
                data["cache_salt"] = salt_for(done.namespace)
            if done.fields is not None:  # its splices by source (/metrics)
                _sources(scope).turn(done.fields.get("leyline"), done.fields["usage"]["leyline"])
                out = annotating(out, done.fields)
            if done.commit is not None:
                out = reading(out, done.commit)
        else:
            data = {k: v for k, v in data.items() if k != "leyline"}
        body = json.dumps(data).encode()
        await self.app(with_body(scope, body), guards.replay(body, receive), out)


def _for_leyline(data: dict[str, object]) -> bool:
    """Does ``data`` carry anything this middleware must check or act on (Leyline's body
    fields, ``context_management``, a ``cache_salt`` of Leyline's)?"""
    return (
        "leyline" in data or "context_management" in data or is_leyline_salt(data.get("cache_salt"))
    )


def _json_object(raw: bytes) -> dict[str, object] | None:
    try:
        data = json.loads(raw) if raw.strip() else None
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _session(value: bytes | None) -> str | None:
    """The ``X-Leyline-Session`` header, checked (``GuardError`` naming it)."""
    if value is None:
        return None
    try:
        return check_session_id(value.decode("utf-8", "replace"), SESSION_HEADER)
    except ValueError as e:
        raise GuardError(str(e).partition(": ")[2], SESSION_HEADER) from None


def _salt(data: dict[str, object], sid: str | None) -> None:
    """Set the session's salt on ``data`` (``GuardError`` for a salt the client may not
    send: see the module docstring)."""
    own = data.get("cache_salt")
    if sid is None:
        if is_leyline_salt(own):
            raise GuardError(
                "a salt starting with 'leyline-' is reserved for Leyline's session "
                f"namespaces; choose another salt, or name a session with {SESSION_HEADER}",
                "cache_salt",
            )
        return
    salt = salt_for(Namespace(session=sid))
    if own not in (None, salt):
        raise GuardError(
            f"cannot be combined with the {SESSION_HEADER} header (the session's blocks "
            "live under its own salt)",
            "cache_salt",
        )
    data["cache_salt"] = salt


def _sources(scope: Scope) -> SpliceSources:
    """The app's count of the chat turns' splices by source (made on first use)."""
    state = _state(scope)
    sources = getattr(state, SOURCES_STATE, None)
    if sources is None:
        sources = SpliceSources()
        setattr(state, SOURCES_STATE, sources)
    return sources


def _front_of(scope: Scope) -> ChatFront | None:
    return getattr(_state(scope), FRONT_STATE, None)


def _own_salt(salt: object) -> bool:
    """A ``cache_salt`` the client chose (not Leyline's)."""
    return salt is not None and not is_leyline_salt(salt)


def _front(scope: Scope) -> ChatFront:
    front = _front_of(scope)
    if front is None:
        raise RuntimeUnavailableError("the Leyline chat front has no engine")
    return front
