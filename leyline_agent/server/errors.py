"""Every failure of a request becomes ``{"error": ErrorBody}`` with a 4xx (or 5xx) status.

=====================================  ======  =============================================
raised                                  status  ``error.type``
=====================================  ======  =============================================
``RequestError`` (bad value, server)    400     ``RequestError``
``ModelNotFoundError``                  404     ``ModelNotFoundError``
FastAPI ``RequestValidationError``      422     ``ValidationError`` (``UnsupportedModeError``
                                                for a reserved directive mode)
``CacheMissError``                      409     ``CacheMissError``
other ``LeylineError``                  400     its class name (``DirectiveError``,
                                                ``UnsupportedModeError``, ``TrajectoryError``..)
other ``ValueError``                    400     ``ValueError``
``RuntimeUnavailableError``             503     ``RuntimeUnavailableError``
Starlette ``HTTPException`` (404/405)   same    ``NotFound`` / ``MethodNotAllowed``
anything else                           500     ``InternalError``
=====================================  ======  =============================================

``type`` is the name of the Leyline error class, so that a client (``HTTPRuntime``) can
raise the same class on its side.
``field`` names the request field at fault, as a path: ``messages[2].role``,
``directives[0].end``, ``prompt[7]``. Errors raised by the layers below carry it as the
prefix of their message (``"directives[0].end: ..."``); it is lifted from there.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from leyline_agent.directives import RESERVED_MODES
from leyline_agent.errors import CacheMissError, LeylineError, RuntimeUnavailableError
from leyline_agent.wire import ErrorBody

log = structlog.get_logger(__name__)

__all__ = ["ModelNotFoundError", "RequestError", "error_response", "field_path", "install"]


class RequestError(LeylineError, ValueError):
    """A request the server refuses before any engine work: bad value, unsupported option."""

    status = 400

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.detail = message


class ModelNotFoundError(RequestError):
    status = 404


def field_path(loc: Sequence[Any]) -> str:
    """``("body", "messages", 2, "role")`` -> ``"messages[2].role"``."""
    out = ""
    for k, part in enumerate(loc):
        if part == "body" and k == 0:
            if len(loc) > 1 and isinstance(loc[1], int):
                out = "body"  # a position in the raw body (bad JSON)
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


def error_response(status: int, type_: str, message: str, field: str | None = None) -> JSONResponse:
    body = ErrorBody(type=type_, message=message, field=field)
    return JSONResponse({"error": body.model_dump()}, status_code=status)


def _validation(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None, bool]:
    parts, first, reserved = [], None, False
    for err in errors[:5]:
        path = field_path(err.get("loc", ()))
        first = first if first is not None else (path or None)
        parts.append(f"{path}: {err.get('msg', 'invalid')}" if path else err.get("msg", "invalid"))
        reserved |= path.endswith(".mode") and str(err.get("input", "")).lower() in _RESERVED
    return "; ".join(parts), first, reserved


_RESERVED = {m.value for m in RESERVED_MODES}


def classify(exc: BaseException) -> tuple[int, str, str, str | None]:
    """(status, type, message, field) of an exception; the one mapping used everywhere."""
    if isinstance(exc, RequestError):
        return exc.status, type(exc).__name__, str(exc), exc.field
    if isinstance(exc, RequestValidationError):
        message, field, reserved = _validation(exc.errors())
        return 422, "UnsupportedModeError" if reserved else "ValidationError", message, field
    if isinstance(exc, CacheMissError):
        return 409, "CacheMissError", str(exc), _lift_field(str(exc)) or "tokens"
    if isinstance(exc, RuntimeUnavailableError):
        return 503, "RuntimeUnavailableError", str(exc), None
    if isinstance(exc, LeylineError):
        return 400, type(exc).__name__, str(exc), _lift_field(str(exc))
    if isinstance(exc, ValueError):
        return 400, "ValueError", str(exc), _lift_field(str(exc))
    return 500, "InternalError", f"{type(exc).__name__}: {exc}", None


def install(app: FastAPI) -> None:
    """Register the handlers that turn exceptions into ``{"error": ErrorBody}``."""

    async def _leyline(request: Request, exc: Exception) -> JSONResponse:
        status, type_, message, field = classify(exc)
        if status >= 500:
            log.error("request failed", path=request.url.path, error=message)
        return error_response(status, type_, message, field)

    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
        return error_response(exc.status_code, type_, f"{request.url.path}: {exc.detail}")

    app.add_exception_handler(RequestValidationError, _leyline)
    app.add_exception_handler(LeylineError, _leyline)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _leyline)
