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
  pool and served other clients' rows. Edits carried in the body (``context_management``,
  ``leyline.edits``, client edits on), which only ``leyline serve`` applies, are a 400 naming
  the field; ``{"leyline": {"client_edits": "off"}}`` asks for nothing and is removed. With ``X-Leyline-Session: id`` the request gets that
  session's salt (a bad id, or a ``cache_salt`` of its own next to the header: 400). A body
  that is not JSON is passed on unchanged (vLLM answers it). A request without a valid key
  on a path vLLM guards is passed on unread: vLLM answers its 401.

The limit is ``LEYLINE_MAX_BODY_BYTES`` (bytes; default 16 MiB, ``leyline serve``'s).
"""

from __future__ import annotations

import json
import os
from typing import Any

from leyline_agent.directives import http_guards
from leyline_agent.directives.http_guards import GuardError
from leyline_agent.namespaces import SESSION_HEADER, Namespace, check_session_id
from leyline_agent.vllm_plugin.namespace import is_leyline_salt, salt_for

__all__ = ["BODY_KEY", "KEYS_STATE", "LeylineGuard", "api_keys", "max_body_bytes"]

BODY_KEY = "leyline.body"  # the scope key of a Leyline route's parsed body
KEYS_STATE = "leyline_api_keys"  # app.state: the key digests (set by init_state)
LEYLINE_PREFIX = "/leyline"
VLLM_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's AuthenticationMiddleware
_FORMS = (b"multipart/form-data", b"application/x-www-form-urlencoded")
# Body fields only ``leyline serve``'s front applies: vLLM would ignore them (a 200 that
# applied nothing), so they are refused by name (``_front_only``).
_NOT_HERE = (
    "this server (vLLM + the Leyline plugin) does not apply edits carried in a request body; "
    "send them as a message-form POST /leyline/v1/directives (wrap_openai and LeylineTransport "
    "do)"
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
            else:
                await self._other(scope, receive, send, path)
        except GuardError as e:
            await http_guards.send_error(send, e)

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
        await self.app(scope, _replay(raw, receive), send)

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
        body = _salted(raw, _header(scope, SESSION_HEADER.lower().encode()))
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers}, _replay(body, receive), send)


def _salted(raw: bytes, session: bytes | None) -> bytes:
    """``raw`` with the session's salt set (or unchanged); ``GuardError`` for a salt the
    client may not send (see the module docstring)."""
    try:
        data = json.loads(raw) if raw.strip() else None
    except (ValueError, RecursionError):
        return raw  # not JSON: vLLM's own answer
    if not isinstance(data, dict):
        return raw
    stripped = _front_only(data)
    own = data.get("cache_salt")
    if session is None:
        if is_leyline_salt(own):
            raise GuardError(
                "a salt starting with 'leyline-' is reserved for Leyline's session "
                f"namespaces; choose another salt, or name a session with {SESSION_HEADER}",
                "cache_salt",
            )
        return json.dumps(data).encode() if stripped else raw
    try:
        sid = check_session_id(session.decode("utf-8", "replace"), SESSION_HEADER)
    except ValueError as e:
        raise GuardError(str(e).partition(": ")[2], SESSION_HEADER) from None
    salt = salt_for(Namespace(session=sid))
    if own not in (None, salt):
        raise GuardError(
            f"cannot be combined with the {SESSION_HEADER} header (the session's blocks "
            "live under its own salt)",
            "cache_salt",
        )
    data["cache_salt"] = salt
    return json.dumps(data).encode()


def _front_only(data: dict[str, Any]) -> bool:
    """Refuse (``GuardError`` naming the field) the body fields that ask for work only
    ``leyline serve``'s front does: ``context_management``, ``leyline.edits`` and client
    edits turned on. ``{"leyline": {"client_edits": "off"}}`` (what the wrapper sends when its
    edits went as directives) asks for nothing: it is removed, and True returned."""
    if "context_management" in data:
        raise GuardError(_NOT_HERE, "context_management")
    if "leyline" not in data:
        return False
    opts = data["leyline"]
    if isinstance(opts, dict) and set(opts) <= {"client_edits"}:
        if opts.get("client_edits", "off") == "off":
            del data["leyline"]
            return True
        raise GuardError(_NOT_HERE, "leyline.client_edits")
    raise GuardError(_NOT_HERE, "leyline.edits" if isinstance(opts, dict) and "edits" in opts
                     else "leyline")  # fmt: skip


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that hands over ``body`` once, then the real channel's messages
    (a disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
