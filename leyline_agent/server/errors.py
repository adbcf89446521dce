"""Every failure of a request becomes ``{"error": ErrorBody}`` with a 4xx (or 5xx) status.

=====================================  ======  =============================================
raised                                  status  ``error.type``
=====================================  ======  =============================================
``RequestError`` (bad value, server)    400     ``RequestError``
``ModelNotFoundError``                  404     ``ModelNotFoundError``
FastAPI ``RequestValidationError``      400     ``ValidationError`` (``UnsupportedModeError``
                                                for a reserved directive mode)
``CacheMissError``                      409     ``CacheMissError``
other ``LeylineError``                  400     its class name (``DirectiveError``,
                                                ``UnsupportedModeError``, ``TrajectoryError``..)
other ``ValueError``                    400     ``ValueError``
``RuntimeUnavailableError``             503     ``RuntimeUnavailableError`` (``QueueTimeoutError``
                                                with a ``Retry-After`` header)
Starlette ``HTTPException`` (404/405)   same    ``NotFound`` / ``MethodNotAllowed``
a body over the size limit              413     ``PayloadTooLargeError`` (field ``body``)
no or a wrong API key (middleware)      401     ``AuthenticationError`` (``authorization``)
a ``Host`` not allowed (middleware)     400     ``HostNotAllowedError`` (field ``host``)
anything else                           500     ``InternalError``
=====================================  ======  =============================================

Every one of them is an answer, never a dropped connection: ``ErrorGuard`` (innermost
middleware) turns any exception a route lets through into the JSON error and returns
normally, so the keep-alive connection stays usable (uvicorn closes a connection whose
application raised).

The body has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (plus
``field``, the same as ``param``), and bad requests are 400 as OpenAI answers them
(FastAPI's default for a validation error would be 422). ``type`` is the name of the
Leyline error class, so that a client (``HTTPRuntime``) can raise the same class on its
side; ``code`` is a snake_case reason (``error_code``; pydantic's error type for a
validation error: ``missing``, ``int_type``).
``field`` names the request field at fault, as a path: ``messages[2].role``,
``directives[0].end``, ``prompt[7]``. Errors raised by the layers below carry it as the
prefix of their message (``"directives[0].end: ..."``); it is lifted from there.
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Sequence
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline_agent.directives import RESERVED_MODES
from leyline_agent.errors import CacheMissError, LeylineError, RuntimeUnavailableError
from leyline_agent.wire import ErrorBody

log = structlog.get_logger(__name__)

__all__ = [
    "ClientDisconnected",
    "ErrorGuard",
    "ModelNotFoundError",
    "RequestError",
    "classify",
    "error_body",
    "error_code",
    "error_response",
    "exception_code",
    "field_path",
    "install",
]


class RequestError(LeylineError, ValueError):
    """A request the server refuses before any engine work: bad value, unsupported option."""

    status = 400

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.detail = message


class ModelNotFoundError(RequestError):
    status = 404


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready (nobody reads the
    answer; 499 as nginx logs it)."""


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _union_tag(part: str) -> bool:
    """pydantic names the member of a union it tried (``list[int]``, ``str``, ``Model``)."""
    return part in _TYPE_TAGS or not part.isidentifier() or part[:1].isupper()


def field_path(loc: Sequence[Any]) -> str:
    """``("body", "messages", 2, "role")`` -> ``"messages[2].role"``; the members of a
    union pydantic tried are left out (``replacement.list[int].1`` -> ``replacement[1]``)."""
    out = ""
    for k, part in enumerate(loc):
        if part == "body" and k == 0:
            if len(loc) > 1 and isinstance(loc[1], int):
                out = "body"  # a position in the raw body (bad JSON)
            continue
        if isinstance(part, str) and _union_tag(part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w]*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)*): ")


def _lift_field(message: str) -> str | None:
    m = _FIELD_PREFIX.match(message)
    return m.group(1) if m else None


def error_response(
    status: int,
    type_: str,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = error_body(type_, message, field, code)
    return JSONResponse({"error": body.model_dump()}, status_code=status, headers=headers)


def error_body(
    type_: str, message: str, field: str | None = None, code: str | None = None
) -> ErrorBody:
    """OpenAI's error shape; ``code`` defaults to the type's (``error_code``)."""
    return ErrorBody(
        type=type_,
        message=_printable(message),
        field=field and _printable(field),
        code=code or error_code(type_),
    )


_CODES = {
    "RequestError": "invalid_value",
    "ValidationError": "invalid_value",
    "ValueError": "invalid_value",
    "DirectiveError": "invalid_directive",
    "TrajectoryError": "invalid_messages",
    "AuthenticationError": "invalid_api_key",
    "NotFound": "not_found",
    "MethodNotAllowed": "method_not_allowed",
    "InternalError": "internal_error",
}


def error_code(type_: str) -> str:
    """``CacheMissError`` -> ``cache_miss``, ``ModelNotFoundError`` -> ``model_not_found``."""
    if type_ in _CODES:
        return _CODES[type_]
    stem = type_.removesuffix("Error") or type_
    return re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower()


def exception_code(exc: BaseException, type_: str) -> str:
    """A validation error's code is pydantic's own (``missing``, ``int_type``...)."""
    if isinstance(exc, RequestValidationError) and exc.errors():
        return str(exc.errors()[0].get("type", "invalid_value")).replace(".", "_")
    return error_code(type_)


def _printable(text: str) -> str:
    """``text`` encodable as UTF-8: a lone surrogate quoted from the input becomes ``\\udXXX``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def exception_response(exc: BaseException) -> JSONResponse:
    """The JSON error answer of ``exc`` (with ``Retry-After`` where the error has one)."""
    status, type_, message, field = classify(exc)
    retry = getattr(exc, "retry_after_s", None)
    headers = {"Retry-After": str(retry)} if retry else None
    return error_response(status, type_, message, field, headers, exception_code(exc, type_))


def _validation(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None, bool]:
    parts, first, reserved = [], None, False
    for err in errors[:5]:
        path = field_path(err.get("loc", ()))
        first = first if first is not None else (path or None)
        parts.append(f"{path}: {err.get('msg', 'invalid')}" if path else err.get("msg", "invalid"))
        is_mode = path == "mode" or path.endswith(".mode")
        reserved |= is_mode and str(err.get("input", "")).lower() in _RESERVED
    return "; ".join(parts), first, reserved


_RESERVED = {m.value for m in RESERVED_MODES}


def classify(exc: BaseException) -> tuple[int, str, str, str | None]:
    """(status, type, message, field) of an exception; the one mapping used everywhere."""
    if isinstance(exc, RequestError):
        return exc.status, type(exc).__name__, str(exc), exc.field
    if isinstance(exc, RequestValidationError):
        message, field, reserved = _validation(exc.errors())
        return 400, "UnsupportedModeError" if reserved else "ValidationError", message, field
    if isinstance(exc, CacheMissError):
        return 409, "CacheMissError", str(exc), _lift_field(str(exc)) or "tokens"
    if isinstance(exc, RuntimeUnavailableError):
        return 503, type(exc).__name__, str(exc), None
    if isinstance(exc, concurrent.futures.CancelledError):  # the worker shut down
        return 503, "RuntimeUnavailableError", "the request was cancelled (shutting down)", None
    if isinstance(exc, StarletteHTTPException):
        return _http_error(exc)
    if isinstance(exc, ClientDisconnected):
        return 499, "ClientDisconnected", str(exc), None
    if isinstance(exc, LeylineError):
        return 400, type(exc).__name__, str(exc), _lift_field(str(exc))
    if isinstance(exc, ValueError):
        return 400, "ValueError", str(exc), _lift_field(str(exc))
    return 500, "InternalError", f"{type(exc).__name__}: {exc}", None


def _http_error(exc: StarletteHTTPException) -> tuple[int, str, str, str | None]:
    status = exc.status_code
    field = getattr(exc, "field", None)
    if status == 400 and field is None:  # FastAPI could not parse the body
        field = "body"
    type_ = getattr(exc, "error_type", None) or {404: "NotFound", 405: "MethodNotAllowed"}.get(
        status, "HTTPError"
    )
    return status, type_, str(exc.detail), field


def install(app: FastAPI) -> None:
    """Register the handlers that turn exceptions into ``{"error": ErrorBody}``; everything
    else is answered by ``ErrorGuard`` (see ``create_app``)."""

    async def _leyline(request: Request, exc: Exception) -> JSONResponse:
        response = exception_response(exc)
        if response.status_code >= 500:
            log.error("request failed", path=request.url.path, error=str(exc))
        return response

    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status, type_, message, field = _http_error(exc)
        if status in (404, 405):
            message = f"{request.url.path}: {message}"
        return error_response(status, type_, message, field, exc.headers)

    app.add_exception_handler(RequestValidationError, _leyline)
    app.add_exception_handler(LeylineError, _leyline)
    app.add_exception_handler(ValueError, _leyline)
    app.add_exception_handler(ClientDisconnected, _leyline)
    app.add_exception_handler(StarletteHTTPException, _http)


class ErrorGuard:
    """Pure ASGI middleware: an exception that reached it becomes the JSON error answer
    (500 ``InternalError`` for anything unexpected), and the call returns normally."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]
            response = exception_response(exc)
            if response.status_code >= 500:
                log.error("request failed", path=scope.get("path"), error=repr(exc))
            if started:  # nothing more can be said on this response
                return
            await response(scope, receive, send)
