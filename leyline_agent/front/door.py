"""``FrontDoor``: the pure ASGI middleware that puts Leyline in front of an engine's own app
(vLLM's OpenAI server: ``vllm_plugin.guard``), with the checks ``leyline serve`` runs
(``http.guards``: same refusals, same answers).

What the engine is, the door reads from an ``EngineAttachment``: the API keys, the chat
front (``front.chat_proxy.ChatFront``), the stats, the path prefixes on which the engine
checks the key itself, and how a request names its cache namespace (a salt field, and the
salts Leyline makes for its namespaces). By path:

- **Leyline routes** (``/leyline/...``): with an API key set, 401 without it (constant-time
  compare); a body over the limit is a 413 (by ``Content-Length`` before a byte is read, else
  as soon as the count passes it); the body is parsed here (not JSON, deeper than
  ``MAX_JSON_DEPTH``, a lone surrogate or a non-finite number: a 400 naming the field) and
  handed to the route in the scope (``BODY_KEY``), so the route never parses it again.
- **Every other POST with a JSON body** (chat, completions, responses, ...): a body over the
  limit is a 413 (the door holds the body to read its salt). A client's own salt that is one
  of Leyline's is refused (400 naming the salt field): such salts are Leyline's session
  namespaces, and a client's salt there would be served other clients' rows. With
  ``X-Leyline-Session: id`` the request gets that session's salt (a bad id, or a salt of its
  own next to the header: 400).
- **Chat requests** (``/v1/chat/completions``) go through the chat front, the turn
  ``leyline serve`` runs (``front.chat_turn``): the request's conversation is found, its
  ``context_management``, declared ``leyline.edits``, client edits and drift are spliced before
  the engine sees it, the answer says what came of them, and its reply is read as it passes
  (``front.replies``) to record the conversation. ``leyline`` and ``context_management``
  outside a chat request are a 400 naming the field, and so is a request that asks for them
  beside a salt of the client's own (``chat_proxy.check_fields``). A body that is not a JSON
  object is passed on unchanged (the engine answers it). A request without a valid key on a
  path the engine guards is passed on unread: the engine answers its 401.
- **Anthropic's Messages API** (``/v1/messages``, ``/v1/messages/count_tokens``) is served
  by the Leyline front (``front.messages_proxy``): a message request goes on as the chat
  request it becomes, through the chat handling above.
- **``GET /metrics``**: the engine's own series, then Leyline's (``metrics.stats_text``).

The limit is ``LEYLINE_MAX_BODY_BYTES`` (``http.guards.max_body_bytes``).
"""

from __future__ import annotations

import json
from collections.abc import Container
from typing import Protocol

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
from leyline_agent.namespaces import SESSION_HEADER, Namespace
from leyline_agent.wire import StatsResponse

__all__ = ["BODY_KEY", "CHAT_PATH", "EngineAttachment", "FrontDoor", "PinWatch"]

BODY_KEY = "leyline.body"  # the scope key of a Leyline route's parsed body
METRICS_PATH = "/metrics"
CHAT_PATH = "/v1/chat/completions"
LEYLINE_PREFIX = "/leyline"
_FORMS = (b"multipart/form-data", b"application/x-www-form-urlencoded")


class PinWatch(Protocol):
    """The namespaces (salts) whose splice results are pinned, and the engine's answer to
    whether one of them lost its result (said once): what ``front.pin_report`` asks."""

    @property
    def watched(self) -> Container[str]: ...

    async def arrive(self, salt: str) -> bool: ...


class EngineAttachment(Protocol):
    """What a front door reads of one engine (module doc)."""

    guarded: tuple[str, ...]  # path prefixes on which the engine checks the API key itself
    salt_field: str  # the body field naming a request's cache namespace

    def keys(self, scope: Scope) -> tuple[bytes, ...]:
        """The API keys' digests (``guards.key_digests``); empty: no key is asked for."""
        ...

    def chat(self, scope: Scope) -> ChatFront | None:
        """The chat front (None: the engine is not attached yet)."""
        ...

    def sources(self, scope: Scope) -> SpliceSources:
        """The app's count of the chat turns' splices by source."""
        ...

    async def stats(self, scope: Scope) -> StatsResponse | None:
        """Leyline's stats (None: no directive route here)."""
        ...

    def pins(self, scope: Scope) -> PinWatch | None:
        """The directive route's pins (None: no directive route here)."""
        ...

    def salt_for(self, ns: Namespace) -> str:
        """The salt of a Leyline namespace."""
        ...

    def is_leyline_salt(self, value: object) -> bool:
        """``value`` is one of the salts Leyline makes (``salt_for``)."""
        ...


class FrontDoor:
    def __init__(self, app: ASGIApp, attachment: EngineAttachment) -> None:
        self.app, self.engine = app, attachment
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

    def _problem(self, scope: Scope) -> str | None:
        """Why the request's key is refused (None: it is not)."""
        keys = self.engine.keys(scope)
        auth = header(scope.get("headers", ()), b"authorization")
        return guards.bearer_problem(auth, keys) if keys else None

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        return await guards.read_capped(scope.get("headers", ()), receive, self.limit)

    async def _leyline(self, scope: Scope, receive: Receive, send: Send) -> None:
        problem = self._problem(scope)
        if problem is not None:
            raise guards.authentication_error(problem)
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        raw = await self._body(scope, receive)
        scope[BODY_KEY] = await guards.parse_body(raw)
        await self.app(scope, guards.replay(raw, receive), send)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = await self.engine.stats(scope)
        if stats is None:
            await self.app(scope, receive, send)
            return
        extra = stats_text(stats, self.engine.sources(scope).snapshot())
        await self.app(scope, receive, appending(send, extra))

    async def _messages(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """Anthropic's Messages API as a chat request through ``_other``."""
        if self._problem(scope) is not None:
            await self.app(scope, receive, send)  # the engine answers its own 401
            return
        raw = await self._body(scope, receive)
        if path == COUNT_PATH:
            await send_json(send, 200, await count_tokens(self._chat(scope), raw))
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
        if path.startswith(self.engine.guarded) and self._problem(scope) is not None:
            await self.app(scope, receive, send)  # the engine answers its own 401
            return
        raw = await self._body(scope, receive)
        data = await guards.body_object(raw)
        headers = scope.get("headers", ())
        sid = guards.session_header(header(headers, SESSION_HEADER.lower().encode()))
        chat = path == CHAT_PATH
        front = self.engine.chat(scope) if chat else None
        field = self.engine.salt_field
        own = data.get(field) if data is not None else None
        own_salt = own is not None and not self.engine.is_leyline_salt(own)
        # an anonymous chat request is tracked when the front's mode is on, as on leyline
        # serve; one with a salt of its own stays in its private namespace, untracked
        tracked = front is not None and front.mode != "off" and not own_salt
        if data is None or (sid is None and not self._for_leyline(data) and not tracked):
            await self.app(scope, guards.replay(raw, receive), send)  # nothing to do here
            return
        check_fields(data, chat=chat, own_salt=own_salt)
        self._salt(data, sid)  # checked before anything is spliced
        out = send
        if chat:
            done = await self._chat(scope).splice(data, sid)  # the turn's edits and drift
            data = done.body
            if done.namespace is not None:
                data[field] = self.engine.salt_for(done.namespace)
            if done.fields is not None:  # its splices by source (/metrics)
                leyline = done.fields.get("leyline")
                self.engine.sources(scope).turn(leyline, done.fields["usage"]["leyline"])
                out = annotating(out, done.fields)
            if done.commit is not None:
                out = reading(out, done.commit)
        else:
            data = {k: v for k, v in data.items() if k != "leyline"}
        body = json.dumps(data).encode()
        await self.app(with_body(scope, body), guards.replay(body, receive), out)

    def _for_leyline(self, data: dict[str, object]) -> bool:
        """Does ``data`` carry anything the door must check or act on (Leyline's body fields,
        ``context_management``, a salt of Leyline's)?"""
        salt = data.get(self.engine.salt_field)
        return (
            "leyline" in data or "context_management" in data or self.engine.is_leyline_salt(salt)
        )

    def _salt(self, data: dict[str, object], sid: str | None) -> None:
        """Set the session's salt on ``data`` (``GuardError`` for a salt the client may not
        send: see the module docstring)."""
        field = self.engine.salt_field
        own = data.get(field)
        if sid is None:
            if self.engine.is_leyline_salt(own):
                raise GuardError(
                    "a salt starting with 'leyline-' is reserved for Leyline's session "
                    f"namespaces; choose another salt, or name a session with {SESSION_HEADER}",
                    field,
                )
            return
        salt = self.engine.salt_for(Namespace(session=sid))
        if own not in (None, salt):
            raise GuardError(
                f"cannot be combined with the {SESSION_HEADER} header (the session's blocks "
                "live under its own salt)",
                field,
            )
        data[field] = salt

    def _chat(self, scope: Scope) -> ChatFront:
        front = self.engine.chat(scope)
        if front is None:
            raise RuntimeUnavailableError("the Leyline chat front has no engine")
        return front
