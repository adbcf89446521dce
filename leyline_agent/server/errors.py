"""Every failure of a request becomes ``{"error": ErrorBody}`` with a 4xx (or 5xx) status.

=====================================  ======  =============================================
raised                                  status  ``error.leyline_type``
=====================================  ======  =============================================
``RequestError`` (bad value, server)    400     ``RequestError``
``ModelNotFoundError`` (``errors``)     404     ``ModelNotFoundError``
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
``field``, the same as ``param``, and ``leyline_type``), and bad requests are 400 as OpenAI
answers them (FastAPI's default for a validation error would be 422). ``type`` is OpenAI's
(``invalid_request_error``, ``authentication_error``, ``not_found_error``,
``rate_limit_error``, ``server_error``: ``http_errors.openai_type``, from the status);
``leyline_type`` is the name of the Leyline error class in the table, so that a client
(``HTTPRuntime``) can raise the same class on its side; ``code`` is a snake_case reason
(``error_code``; pydantic's error type for a validation error: ``missing``, ``int_type``).
``field`` names the request field at fault, as a path: ``messages[2].role``,
``directives[0].end``, ``prompt[7]``. Errors raised by the layers below carry it as the
prefix of their message (``"directives[0].end: ..."``); it is lifted from there. The part
of this mapping that is not FastAPI's is ``leyline_agent.directives.answers``, shared with
the vLLM plugin's routes.
"""

from __future__ import annotations

import concurrent.futures

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline_agent.directives import answers
from leyline_agent.errors import LeylineError, RequestError
from leyline_agent.http_errors import error_body, validation_answer

log = structlog.get_logger(__name__)

DEFAULT_RETRY_AFTER_S = 5  # a 503 whose error names no wait (a restarting server)

__all__ = [
    "ClientDisconnected",
    "ErrorGuard",
    "RequestError",
    "TrackedSend",
    "classify",
    "error_response",
    "exception_code",
    "install",
]


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready (nobody reads the
    answer; 499 as nginx logs it)."""


def error_response(
    status: int,
    type_: str,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = error_body(type_, message, field, code, status=status)
    return JSONResponse({"error": body.model_dump()}, status_code=status, headers=headers)


def exception_code(exc: BaseException, type_: str) -> str:
    """A validation error's code is pydantic's own (``missing``, ``int_type``...)."""
    if isinstance(exc, RequestValidationError) and exc.errors():
        return str(exc.errors()[0].get("type", "invalid_value")).replace(".", "_")
    return answers.error_code_of(exc, type_)


def exception_response(exc: BaseException) -> JSONResponse:
    """The JSON error answer of ``exc``, with ``Retry-After`` where the error has one; every
    other 503 (a request that reached a route once the server was shutting down) says
    ``DEFAULT_RETRY_AFTER_S``."""
    status, type_, message, field = classify(exc)
    retry = getattr(exc, "retry_after_s", None) or (
        DEFAULT_RETRY_AFTER_S if status == 503 else None
    )
    headers = {"Retry-After": str(retry)} if retry else None
    return error_response(status, type_, message, field, headers, exception_code(exc, type_))


def classify(exc: BaseException) -> tuple[int, str, str, str | None]:
    """(status, type, message, field) of an exception: what only FastAPI and the worker
    raise here, the rest as every Leyline route answers it (``directives.answers``)."""
    if isinstance(exc, RequestValidationError):
        return validation_answer(exc.errors())
    if isinstance(exc, concurrent.futures.CancelledError):  # the worker shut down
        return 503, "RuntimeUnavailableError", "the request was cancelled (shutting down)", None
    if isinstance(exc, StarletteHTTPException):
        return _http_error(exc)
    if isinstance(exc, ClientDisconnected):
        return 499, "ClientDisconnected", str(exc), None
    return answers.classify(exc)


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


class TrackedSend:
    """An ASGI ``send`` that remembers whether the response has started (after that, an
    error can no longer be answered on it)."""

    def __init__(self, send: Send) -> None:
        self.send, self.started = send, False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class ErrorGuard:
    """Pure ASGI middleware: an exception that reached it becomes the JSON error answer
    (500 ``InternalError`` for anything unexpected), and the call returns normally."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tracked = TrackedSend(send)
        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]
            response = exception_response(exc)
            if response.status_code >= 500:
                log.error("request failed", path=scope.get("path"), error=repr(exc))
            if tracked.started:  # nothing more can be said on this response
                return
            await response(scope, receive, send)
