"""Checks every Leyline HTTP front runs before a body reaches a route: size, key, JSON, text.

Written once, for ``leyline serve`` and for the vLLM plugin's routes (which sit inside
vLLM's own FastAPI app), so that both refuse the same inputs with the same answers:

- **body size** (``content_length_over``, ``read_body``): a declared ``Content-Length`` over
  the limit is refused before a byte is read; a body without one (chunked) is counted as it
  arrives and refused as soon as the count passes the limit. 413 ``PayloadTooLargeError``
  naming ``body``.
- **API key** (``bearer_problem``; ``key_index``, which ``leyline serve``'s tenant keys use
  too): ``Authorization: Bearer KEY`` compared with every configured key in constant time
  (``hmac.compare_digest`` over SHA-256 digests, so the time does not depend on where a
  guess first differs, nor on the key's length). 401
  ``AuthenticationError`` naming ``authorization``, with ``WWW-Authenticate: Bearer``.
  ``AnthropicKeyHeader``, outside the key check, lets the Messages routes take the key as
  the Anthropic SDK sends it (``x-api-key``).
- **JSON** (``parse_json``): not JSON, or nested deeper than ``MAX_JSON_DEPTH``, is a 400
  naming ``body`` (Python's parser would raise ``RecursionError`` on a deep enough body).
- **session** (``session_header``): the ``X-Leyline-Session`` header checked
  (``namespaces.check_session_id``: ids starting with the server's own prefix are refused),
  a 400 naming the header.
- **text** (``check_json_text``): Python's ``json`` accepts an escaped lone surrogate
  (``"\\ud800"``: a string that cannot be encoded as UTF-8, which a tokenizer then fails on)
  and ``NaN`` / ``Infinity`` (or ``1e400``); the first such value is a 400 naming its path
  (``new_messages[0].content``, ``directives[1].replacement``). The walk is iterative and
  also enforces the depth bound, so it never exhausts the stack.

Errors are ``InvalidRequestError`` subclasses carrying ``status`` and ``field``;
``error_message`` turns one into the ``{"error": ...}`` body of ``http_errors.error_body``
(the shape every Leyline route answers), ``send_error`` sends it on a raw ASGI ``send``. No
torch, no web framework.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from leyline_agent.errors import InvalidRequestError
from leyline_agent.http import json_parse
from leyline_agent.http.asgi import ASGIApp, Receive, Scope, Send, header
from leyline_agent.http.json_parse import MAX_JSON_VALUES, TooManyValuesError
from leyline_agent.http.offload import off_loop
from leyline_agent.http_errors import error_body
from leyline_agent.namespaces import SESSION_HEADER, check_session_id

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "OFF_LOOP_BODY_BYTES",
    "AnthropicKeyHeader",
    "AuthenticationError",
    "BAD_KEY",
    "MISSING_KEY",
    "authentication_error",
    "GuardError",
    "JSONBodyError",
    "MESSAGES_PATHS",
    "PayloadTooLargeError",
    "bearer_problem",
    "body_object",
    "bearer_token",
    "check_json_text",
    "content_length_over",
    "error_message",
    "json_object",
    "key_digests",
    "key_index",
    "max_body_bytes",
    "parse_body",
    "parse_json",
    "read_body",
    "read_capped",
    "read_json",
    "replay",
    "send_error",
    "session_header",
]

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 128
_SURROGATE = re.compile("[\ud800-\udfff]")
_NAME = re.compile(r"^[A-Za-z_]\w*$")
Headers = Iterable[tuple[bytes, bytes]]


class GuardError(InvalidRequestError):
    """A request refused by a guard: ``status``, ``field``, the answer's extra headers."""

    status = 400
    headers: dict[str, str] = {}
    type_name = "RequestError"  # as ``leyline serve`` names a refused value
    code: str | None = None  # None: the type's (``http_errors.error_code``)


class JSONBodyError(GuardError):
    """A body that is not JSON, answered as FastAPI's own parse error is on ``leyline serve``
    (``body[POSITION]: JSON decode error``)."""

    type_name = "ValidationError"
    code = "json_invalid"

    def __init__(self, position: int) -> None:
        super().__init__("JSON decode error", f"body[{position}]")


class PayloadTooLargeError(GuardError):
    status = 413
    type_name = "PayloadTooLargeError"

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than the limit of {limit} bytes")
        self.field = "body"  # named by ``field``, not by a prefix of the message


class AuthenticationError(GuardError):
    status = 401
    type_name = "AuthenticationError"
    headers = {"WWW-Authenticate": "Bearer"}


# -- body size ---------------------------------------------------------------------------
def max_body_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """A plugin's body limit: ``LEYLINE_MAX_BODY_BYTES`` (bytes; default ``leyline serve``'s,
    ``DEFAULT_MAX_BODY_BYTES``)."""
    raw = environ.get("LEYLINE_MAX_BODY_BYTES", "")
    if not raw:
        return DEFAULT_MAX_BODY_BYTES
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"LEYLINE_MAX_BODY_BYTES: {raw!r} must be a whole number >= 1")
    return int(raw)


async def read_capped(headers: Headers, receive: Receive, limit: int) -> bytes:
    """A request's whole body, refused (``PayloadTooLargeError``) by its declared length
    (``content_length_over``) or as soon as it passes ``limit`` (``read_body``)."""
    if content_length_over(headers, limit):
        raise PayloadTooLargeError(limit)
    return await read_body(receive, limit)


async def read_json(headers: Headers, receive: Receive, limit: int) -> Any:
    """A request's body, size-checked (``read_capped``) and parsed (``parse_body``; an
    empty body is None): what a plugin's Leyline route reads."""
    return await parse_body(await read_capped(headers, receive, limit))


def content_length_over(headers: Headers, limit: int) -> bool:
    """The request declares a ``Content-Length`` over ``limit``."""
    declared = (header(headers, b"content-length") or b"").strip()
    return declared.isdigit() and int(declared) > limit


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole body from an ASGI ``receive``; ``PayloadTooLargeError`` as soon as it
    passes ``limit`` (the rest is not read)."""
    parts, seen, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client left
            break
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            raise PayloadTooLargeError(limit)
        parts.append(chunk)
        more = message.get("more_body", False)
    return b"".join(parts)


def replay(body: bytes, receive: Receive) -> Receive:
    """An ASGI ``receive`` that hands over ``body`` (read by ``read_body``) once, then the
    real channel's messages (a disconnect)."""
    sent = False

    async def replayed() -> MutableMapping[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


# -- API key -----------------------------------------------------------------------------
def key_digests(keys: Iterable[str]) -> tuple[bytes, ...]:
    """The configured keys as SHA-256 digests (what ``bearer_problem`` compares)."""
    return tuple(hashlib.sha256(k.encode("utf-8")).digest() for k in keys if k)


MISSING_KEY = "missing 'Authorization: Bearer <key>'"
BAD_KEY = "the API key is not valid"


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The key of ``Authorization: Bearer KEY`` (None: no such header)."""
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def key_index(token: bytes, digests: Sequence[bytes]) -> int | None:
    """Which of the keys (``key_digests``) ``token`` is (None: none). Every key is compared,
    in constant time over SHA-256 digests, whatever the first one answered."""
    presented = hashlib.sha256(token).digest()
    found = None
    for i, digest in enumerate(digests):
        if hmac.compare_digest(digest, presented):
            found = i
    return found


def bearer_problem(authorization: bytes | None, digests: Sequence[bytes]) -> str | None:
    """None if ``Authorization`` names one of the keys (``key_index``), else why not."""
    token = bearer_token(authorization)
    if token is None:
        return MISSING_KEY
    return None if key_index(token, digests) is not None else BAD_KEY


def authentication_error(problem: str) -> AuthenticationError:
    return AuthenticationError(problem, "authorization")


MESSAGES_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


class AnthropicKeyHeader:
    """Pure ASGI middleware, placed outside the key check: a request to Anthropic's Messages
    routes (``MESSAGES_PATHS``) that carries ``x-api-key`` and no ``Authorization`` (what the
    ``anthropic`` SDK sends for ``api_key=``) goes on with ``Authorization: Bearer <x-api-key>``
    added, so the one key check (``bearer_problem``, or vLLM's own) judges that key. Other
    routes, and a request that sends ``Authorization``, pass unchanged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http" and path in MESSAGES_PATHS:
            headers = list(scope.get("headers", ()))
            key = header(headers, b"x-api-key")
            if key is not None and header(headers, b"authorization") is None:
                headers.append((b"authorization", b"Bearer " + key.strip()))
                scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


def session_header(value: str | bytes | None) -> str | None:
    """The ``X-Leyline-Session`` header's session id (None: no header); ``GuardError``
    naming the header for a bad id (``namespaces.check_session_id``)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    try:
        return check_session_id(value, SESSION_HEADER)
    except ValueError as e:
        raise GuardError(str(e).partition(": ")[2] or str(e), SESSION_HEADER) from None


# -- JSON --------------------------------------------------------------------------------
OFF_LOOP_BODY_BYTES = 256 << 10  # a smaller body parses in well under a millisecond


def parse_json(
    raw: bytes, max_depth: int = MAX_JSON_DEPTH, loads: Callable[[bytes], Any] = json.loads
) -> Any:
    """``raw`` parsed by ``loads`` (``json_parse.loads`` off the event loop), checked by
    ``check_json_text``; ``GuardError`` naming the field."""
    try:
        body = loads(raw)
    except TooManyValuesError as e:
        raise GuardError(f"{e}; a request has at most {MAX_JSON_VALUES}", "body") from None
    except RecursionError:
        raise GuardError(f"nested deeper than {max_depth} levels", "body") from None
    except json.JSONDecodeError as e:
        raise JSONBodyError(e.pos) from None
    except ValueError:  # not UTF-8 (UnicodeDecodeError)
        raise JSONBodyError(0) from None
    check_json_text(body, max_depth)
    return body


def json_object(raw: bytes, loads: Callable[[bytes], Any] = json.loads) -> dict[str, Any] | None:
    """``raw`` as a JSON object, or None (empty, not JSON, or not an object): for a front
    that passes such a body on to the engine, which answers it. A body of more than
    ``MAX_JSON_VALUES`` values (``json_parse.loads``) is refused, as every Leyline front
    refuses it."""
    try:
        data = loads(raw) if raw.strip() else None
    except TooManyValuesError as e:
        raise GuardError(f"{e}; a request has at most {MAX_JSON_VALUES}", "body") from None
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


async def parse_body(raw: bytes) -> Any:
    """``parse_json(raw)`` (None for an empty body), run off the event loop with
    ``json_parse.loads`` for a body of ``OFF_LOOP_BODY_BYTES`` or more: a body of millions of
    small values neither holds the loop nor parses for long (``json_parse``)."""
    if not raw.strip():
        return None
    if len(raw) < OFF_LOOP_BODY_BYTES:
        return parse_json(raw)
    return await off_loop(parse_json, raw, MAX_JSON_DEPTH, json_parse.loads)


async def body_object(raw: bytes) -> dict[str, Any] | None:
    """``json_object(raw)``, off the event loop as ``parse_body`` is for a large body."""
    if len(raw) < OFF_LOOP_BODY_BYTES:
        return json_object(raw)
    return await off_loop(json_object, raw, json_parse.loads)


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    name = key if _NAME.match(key) else repr(key)
    return f"{path}.{name}" if path else name


_PLAIN = (int, bool, type(None))  # JSON values with nothing to check


def check_json_text(body: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """``GuardError`` naming the first lone surrogate, non-finite number or level past
    ``max_depth`` of a parsed body (iterative: a deep body cannot exhaust the stack).

    Linear in the body: a value's path is kept as a link to its parent's (``_Where``) and
    spelled out only for the error, never built for every value."""
    stack: list[tuple[_Where | None, int, Any]] = [(None, 0, body)]
    while stack:
        where, depth, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise GuardError(
                    "contains a lone UTF-16 surrogate (\\ud800-\\udfff); text must be Unicode",
                    _path(where),
                )
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise GuardError(f"{value} is not a JSON number", _path(where))
        elif isinstance(value, dict | list):
            if depth >= max_depth:
                raise GuardError(f"nested deeper than {max_depth} levels", "body")
            if isinstance(value, dict):
                for key in value:
                    if _SURROGATE.search(key):
                        raise GuardError("a key contains a lone UTF-16 surrogate", _path(where))
                pairs: Iterable[tuple[Any, Any]] = value.items()
            else:
                pairs = enumerate(value)
            # ints, booleans and nulls need no check: skipped before anything is kept for them
            items = [((where, k), depth + 1, v) for k, v in pairs if type(v) not in _PLAIN]
            stack.extend(reversed(items))


_Where = tuple[Any, Any]  # (the parent's _Where or None, this value's key or index)


def _path(where: _Where | None) -> str:
    keys = []
    while where is not None:
        where, key = where
        keys.append(key)
    path = ""
    for key in reversed(keys):
        path = _join(path, key)
    return path or "body"


# -- answers -----------------------------------------------------------------------------
def error_message(exc: GuardError) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, JSON bytes) of the answer to ``exc``."""
    body = error_body(exc.type_name, str(exc), exc.field, exc.code, status=exc.status)
    raw = json.dumps(
        {"error": body.model_dump(mode="json")},
        ensure_ascii=False, allow_nan=False, separators=(",", ":"),
    ).encode("utf-8")  # fmt: skip
    return exc.status, dict(exc.headers), raw


async def send_error(send: Send, exc: GuardError) -> None:
    """Answer ``exc`` on a raw ASGI ``send`` (the request has not been answered yet)."""
    status, extra, raw = error_message(exc)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})
