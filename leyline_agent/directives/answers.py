"""The one mapping from an exception to a Leyline route's error answer, for every front.

``leyline serve`` (``server/errors.py``, which adds what only FastAPI and its worker raise),
the directive service (``directives.service``: the vLLM and SGLang plugins' directive
routes) and the vLLM plugin's other routes answer through ``classify`` and
``error_code_of``, so the same bad request gets the same status and the same body from
each: a guard's refusal (``http.guards.GuardError``: its own status, type and code), a body
pydantic refused (``ValidationError``: 400, pydantic's error type as the code), then every
Leyline error as ``http_errors.classify`` answers it.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from leyline_agent.errors import RequestError
from leyline_agent.http.guards import GuardError
from leyline_agent.http_errors import classify as classify_leyline
from leyline_agent.http_errors import error_body, error_code, validation_answer

__all__ = ["classify", "error_code_of", "error_content"]


def classify(exc: BaseException) -> tuple[int, str, str, str | None]:
    """(status, type, message, field) of ``exc``."""
    if isinstance(exc, GuardError):
        return exc.status, exc.type_name, str(exc), exc.field
    if isinstance(exc, ValidationError):
        return validation_answer(exc.errors())
    if isinstance(exc, RequestError):
        return exc.status, type(exc).__name__, str(exc), exc.field
    return classify_leyline(exc)


def error_code_of(exc: BaseException, type_: str) -> str:
    """A guard's own code, pydantic's error type for a validation error (``missing``,
    ``int_type``), else the type's (``http_errors.error_code``)."""
    if isinstance(exc, GuardError) and exc.code:
        return exc.code
    errors = exc.errors() if isinstance(exc, ValidationError) else None
    if errors:
        return str(errors[0].get("type", "invalid_value")).replace(".", "_")
    return error_code(type_)


def error_content(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(status, ``{"error": ErrorBody}``) of ``exc``."""
    status, kind, message, field = classify(exc)
    body = error_body(kind, message, field, error_code_of(exc, kind), status=status)
    return status, {"error": body.model_dump(mode="json")}
