"""``LeylineGuard``: the pure ASGI middleware the plugin puts in front of vLLM's app.

vLLM checks ``--api-key`` only on its own path prefixes (``/v1``, ``/v2``, ...), and reads
``cache_salt`` from a client's body as it is. So, with the shared checks of
``leyline_agent.directives.http_guards`` (the ones ``leyline serve`` runs, same answers):

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
- **Chat requests** (``/v1/chat/completions``) go through ``chat_front``, the Leyline front
  ``leyline serve`` runs (``front.chat_turn``): the request's conversation is found, its
  ``context_management``, declared ``leyline.edits``, client edits and drift are spliced
  before vLLM sees it, the answer says what came of them, and its reply is read as it passes
  (``replies``) to record the conversation. ``leyline`` and ``context_management`` outside a
  chat request are a 400 naming the field, and so is a request that asks for them beside a
  ``cache_salt`` of the client's own (its rows are the client's private namespace; without
  such a field that request is served untracked). A body that is not JSON is passed on
  unchanged (vLLM answers it). A request without a valid key on a path vLLM guards is
  passed on unread: vLLM answers its 401.
- **Anthropic's Messages API** (``/v1/messages``, ``/v1/messages/count_tokens``) is served
  by the Leyline front (``messages``), not vLLM's own Anthropic routes: a message request
  goes on as the chat request it becomes, through the chat handling above.
- **``GET /metrics``**: vLLM's own series, then Leyline's (``leyline_agent.metrics``: the
  counters of ``/leyline/v1/stats`` and the chat turns' splices by source).

The limit is ``LEYLINE_MAX_BODY_BYTES`` (bytes; default 16 MiB, ``leyline serve``'s).
"""

from __future__ import annotations

import json
import os
from typing import Any

from leyline_agent.directives import http_guards
from leyline_agent.directives.answers import error_content
from leyline_agent.directives.http_guards import GuardError
from leyline_agent.errors import LeylineError, RuntimeUnavailableError
from leyline_agent.metrics import SpliceSources, stats_text
from leyline_agent.namespaces import SESSION_HEADER, Namespace, check_session_id
from leyline_agent.vllm_plugin.chat_front import MODES, ChatFront, annotate
from leyline_agent.vllm_plugin.messages import (
    COUNT_PATH,
    MESSAGES_PATH,
    count_tokens,
    messages_request,
    translating,
)
from leyline_agent.vllm_plugin.namespace import is_leyline_salt, salt_for
from leyline_agent.vllm_plugin.replies import ReplyReader
from leyline_agent.wire import StatsResponse

__all__ = ["BODY_KEY", "FRONT_STATE", "KEYS_STATE", "LeylineGuard", "api_keys", "max_body_bytes"]

BODY_KEY = "leyline.body"  # the scope key of a Leyline route's parsed body
KEYS_STATE = "leyline_api_keys"  # app.state: the key digests (set by init_state)
FRONT_STATE = "leyline_chat"  # app.state: the ``chat_front.ChatFront`` (set by init_state)
SOURCES_STATE = "leyline_splice_sources"  # app.state: ``metrics.SpliceSources``
METRICS_PATH = "/metrics"
CHAT_PATH = "/v1/chat/completions"
LEYLINE_PREFIX = "/leyline"
VLLM_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's AuthenticationMiddleware
_FORMS = (b"multipart/form-data", b"application/x-www-form-urlencoded")
# Body fields the front refuses by name where it cannot act on them (``_front_checks``):
# vLLM would ignore them (a 200 that applied nothing).
_CHAT_ONLY = "rides with a chat request only"
_OWN_SALT = (
    "a request with a cache_salt of its own is served in that private namespace, which "
    "Leyline does not splice; drop the salt, or name a session with " + SESSION_HEADER
)


def max_body_bytes() -> int:
    raw = os.environ.get("LEYLINE_MAX_BODY_BYTES", "")
    if not raw:
        return http_guards.DEFAULT_MAX_BODY_BYTES
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"LEYLINE_MAX_BODY_BYTES: {raw!r} must be a whole number >= 1")
    return int(raw)


def api_keys(args: Any) -> tuple[bytes, ...]:
    """The keys vLLM itself checks: ``--api-key`` (repeatable) over ``VLLM_API_KEY``."""
    given = list(getattr(args, "api_key", None) or []) or [os.environ.get("VLLM_API_KEY", "")]
    if isinstance(getattr(args, "api_key", None), str):
        given = [args.api_key]
    return http_guards.key_digests(k for k in given if k)


def _header(scope: Any, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


class LeylineGuard:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.limit = max_body_bytes()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
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
            await http_guards.send_error(send, e)
        except LeylineError as e:  # the chat front's refusals and failures
            await _send_answer(send, e)

    def _keys(self, scope: Any) -> tuple[bytes, ...] | None:
        app = scope.get("app")
        state = getattr(app, "state", None)
        return getattr(state, KEYS_STATE, None)

    async def _leyline(self, scope: Any, receive: Any, send: Any) -> None:
        keys = self._keys(scope)
        if keys is None:  # before init_state: the environment's key, as vLLM has it
            keys = api_keys(None)
        if keys:
            problem = http_guards.bearer_problem(_header(scope, b"authorization"), keys)
            if problem is not None:
                raise http_guards.authentication_error(problem)
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        if http_guards.content_length_over(scope.get("headers", ()), self.limit):
            raise http_guards.PayloadTooLargeError(self.limit)
        raw = await http_guards.read_body(receive, self.limit)
        scope[BODY_KEY] = http_guards.parse_json(raw) if raw.strip() else None
        await self.app(scope, http_guards.replay(raw, receive), send)

    async def _metrics(self, scope: Any, receive: Any, send: Any) -> None:
        """vLLM's ``/metrics`` with Leyline's series after its own (``metrics.stats_text``)."""
        route = getattr(getattr(scope.get("app"), "state", None), "leyline", None)
        if route is None:
            await self.app(scope, receive, send)
            return
        stats = StatsResponse.model_validate(await route.stats())
        extra = stats_text(stats, _sources(scope).snapshot())
        await self.app(scope, receive, _appending(send, extra))

    async def _messages(self, scope: Any, receive: Any, send: Any, path: str) -> None:
        """Anthropic's Messages API as a chat request through ``_other`` (``messages``)."""
        keys = self._keys(scope)
        if keys and http_guards.bearer_problem(_header(scope, b"authorization"), keys) is not None:
            await self.app(scope, receive, send)  # vLLM answers its own 401
            return
        if http_guards.content_length_over(scope.get("headers", ()), self.limit):
            raise http_guards.PayloadTooLargeError(self.limit)
        raw = await http_guards.read_body(receive, self.limit)
        if path == COUNT_PATH:
            await _send_json(send, 200, await count_tokens(_front(scope), raw))
            return
        req, body = messages_request(raw)
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        chat = {**scope, "path": CHAT_PATH, "raw_path": CHAT_PATH.encode(), "headers": headers}
        out = translating(send, req)
        await self._other(chat, http_guards.replay(body, receive), out, CHAT_PATH)

    async def _other(self, scope: Any, receive: Any, send: Any, path: str) -> None:
        ctype = (_header(scope, b"content-type") or b"").lower()
        if scope.get("method") != "POST" or ctype.startswith(_FORMS):
            await self.app(scope, receive, send)
            return
        keys = self._keys(scope)
        if keys and path.startswith(VLLM_GUARDED):
            if http_guards.bearer_problem(_header(scope, b"authorization"), keys) is not None:
                await self.app(scope, receive, send)  # vLLM answers its own 401
                return
        if http_guards.content_length_over(scope.get("headers", ()), self.limit):
            raise http_guards.PayloadTooLargeError(self.limit)
        raw = await http_guards.read_body(receive, self.limit)
        data = _json_object(raw)
        sid = _session(_header(scope, SESSION_HEADER.lower().encode()))
        chat = path == CHAT_PATH
        front = _front_of(scope) if chat else None
        own_salt = data is not None and _own_salt(data.get("cache_salt"))
        # an anonymous chat request is tracked when the front's mode is on, as on leyline
        # serve; one with a salt of its own stays in its private namespace, untracked
        tracked = front is not None and front.mode != "off" and not own_salt
        if data is None or (sid is None and not _for_leyline(data) and not tracked):
            await self.app(scope, http_guards.replay(raw, receive), send)  # nothing to do here
            return
        _front_checks(data, chat=chat, own_salt=own_salt)
        _salt(data, sid)  # checked before anything is spliced
        fields = commit = None
        if chat:
            done = await _front(scope).splice(data, sid)  # the turn's edits and drift
            data, fields, commit = done.body, done.fields, done.commit
            if fields is not None:  # its splices by source (/metrics)
                _sources(scope).turn(fields.get("leyline"), fields["usage"]["leyline"])
        else:
            data = {k: v for k, v in data.items() if k != "leyline"}
        body = json.dumps(data).encode()
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        out = send if fields is None else _annotating(send, fields)
        out = out if commit is None else _reading(out, commit)
        await self.app({**scope, "headers": headers}, http_guards.replay(body, receive), out)


def _for_leyline(data: dict[str, Any]) -> bool:
    """Does ``data`` carry anything this middleware must check or act on (Leyline's body
    fields, ``context_management``, a ``cache_salt`` of Leyline's)?"""
    return (
        "leyline" in data or "context_management" in data or is_leyline_salt(data.get("cache_salt"))
    )


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw) if raw.strip() else None
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _session(header: bytes | None) -> str | None:
    """The ``X-Leyline-Session`` header, checked (``GuardError`` naming it)."""
    if header is None:
        return None
    try:
        return check_session_id(header.decode("utf-8", "replace"), SESSION_HEADER)
    except ValueError as e:
        raise GuardError(str(e).partition(": ")[2], SESSION_HEADER) from None


def _salt(data: dict[str, Any], sid: str | None) -> None:
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


def _sources(scope: Any) -> SpliceSources:
    """The app's count of the chat turns' splices by source (made on first use)."""
    state = scope["app"].state
    sources = getattr(state, SOURCES_STATE, None)
    if sources is None:
        sources = SpliceSources()
        setattr(state, SOURCES_STATE, sources)
    return sources


def _appending(send: Any, extra: bytes) -> Any:
    """An ASGI ``send`` that adds ``extra`` at the end of a 200 answer's body."""
    ok = False

    async def appended(message: dict[str, Any]) -> None:
        nonlocal ok
        if message["type"] == "http.response.start":
            ok = message.get("status") == 200
            if ok:
                headers = [
                    h for h in message.get("headers", ()) if h[0].lower() != b"content-length"
                ]
                message = {**message, "headers": headers}
        elif message["type"] == "http.response.body" and ok and not message.get("more_body"):
            message = {**message, "body": message.get("body", b"") + extra}
        await send(message)

    return appended


def _front_of(scope: Any) -> ChatFront | None:
    return getattr(getattr(scope.get("app"), "state", None), FRONT_STATE, None)


def _own_salt(salt: object) -> bool:
    """A ``cache_salt`` the client chose (not Leyline's)."""
    return salt is not None and not is_leyline_salt(salt)


def _front(scope: Any) -> ChatFront:
    front = _front_of(scope)
    if front is None:
        raise RuntimeUnavailableError("the Leyline chat front has no engine")
    return front


def _front_checks(data: dict[str, Any], chat: bool, own_salt: bool) -> None:
    """Refuse (``GuardError`` naming the field) the body fields that ask for work this
    front cannot do: ``context_management``, ``leyline.edits`` or client edits turned on
    anywhere but in a chat request, or beside a ``cache_salt`` of the client's own.
    ``{"leyline": {"client_edits": "off"}}`` asks for nothing."""
    if "context_management" in data:
        if not chat:
            raise GuardError("context_management " + _CHAT_ONLY, "context_management")
        if own_salt:
            raise GuardError(_OWN_SALT, "cache_salt")
    if "leyline" not in data:
        return
    opts = data["leyline"]
    if not isinstance(opts, dict):
        raise GuardError("must be an object", "leyline")
    unknown = sorted(set(opts) - {"client_edits", "edits"})
    if unknown:
        raise GuardError(f"unknown option {unknown[0]!r}", f"leyline.{unknown[0]}")
    mode = opts.get("client_edits", "off")
    if mode not in MODES:
        raise GuardError(f"must be one of {list(MODES)}", "leyline.client_edits")
    if "edits" in opts and not chat:
        raise GuardError("edits " + _CHAT_ONLY, "leyline.edits")
    if "edits" in opts:
        return  # checked with the messages (``body_edits.request_edits``)
    if mode != "off" and not chat:
        raise GuardError("client edits " + _CHAT_ONLY, "leyline.client_edits")
    if mode != "off" and own_salt:
        raise GuardError(_OWN_SALT, "cache_salt")


def _reading(send: Any, commit: Any) -> Any:
    """An ASGI ``send`` that reads a 200 chat answer's reply as it passes (``replies``) and
    calls ``commit(reply)`` once it is complete; an answer that failed commits nothing."""
    reader: ReplyReader | None = None

    async def reading(message: dict[str, Any]) -> None:
        nonlocal reader
        if message["type"] == "http.response.start" and message.get("status") == 200:
            ctype = dict((k.lower(), v) for k, v in message.get("headers", ()))
            stream = ctype.get(b"content-type", b"").startswith(b"text/event-stream")
            reader = ReplyReader(stream)
        elif message["type"] == "http.response.body" and reader is not None:
            reader.feed(message.get("body", b""))
            if not message.get("more_body", False):
                reply = reader.reply()
                if reply is not None:
                    commit(reply)
        await send(message)

    return reading


def _annotating(send: Any, fields: dict[str, Any]) -> Any:
    """An ASGI ``send`` that adds ``fields`` to a 200 answer: to the JSON object, or to the
    first event of a stream (``chat_front.annotate``); any other answer passes unchanged."""
    held: dict[str, Any] = {}
    done = False

    async def annotated(message: dict[str, Any]) -> None:
        nonlocal done
        if done:
            await send(message)
            return
        if message["type"] == "http.response.start":
            if message.get("status") != 200:
                done = True
                await send(message)
                return
            held["start"], held["buf"] = message, b""
            return
        if message["type"] != "http.response.body" or "start" not in held:
            await send(message)
            return
        start = held["start"]
        ctype = dict((k.lower(), v) for k, v in start.get("headers", ())).get(b"content-type", b"")
        stream = ctype.startswith(b"text/event-stream")
        held["buf"] += message.get("body", b"")
        more = message.get("more_body", False)
        if more and (not stream or b"\n\n" not in held["buf"]):
            return  # the whole answer, or a stream's whole first event
        body = annotate(held["buf"], fields, stream)
        headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
        if not stream:
            headers.append((b"content-length", str(len(body)).encode()))
        done = True
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": more})

    return annotated


async def _send_answer(send: Any, exc: LeylineError) -> None:
    """Answer ``exc`` as every Leyline route answers it (``directives.answers``)."""
    status, content = error_content(exc)
    await _send_json(send, status, content)


async def _send_json(send: Any, status: int, content: Any) -> None:
    raw = json.dumps(content, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})
