"""Every failure of a Leyline route on vLLM as ``{"error": {"type", "message", "field", "code"}}``.

The mapping is ``leyline_agent.http_errors`` (the one ``leyline serve`` and the SGLang route
use), with what only this route meets: a refused guard check
(``http_guards.GuardError``: 400, 401, 413) with its own status and type, and a
``RuntimeUnavailableError`` (503) naming the setting at fault when its message starts with
it. A bad body is 400 ``ValidationError``, as on ``leyline serve``.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from leyline_agent.directives.http_guards import GuardError
from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.http_errors import classify as classify_leyline
from leyline_agent.http_errors import error_body, lift_field, validation_answer

__all__ = ["classify", "error_content"]


def classify(exc: BaseException) -> tuple[int, str, str, str | None]:
    if isinstance(exc, ValidationError):
        return validation_answer(exc.errors())
    if isinstance(exc, GuardError):
        return exc.status, exc.type_name, str(exc), exc.field
    if isinstance(exc, RuntimeUnavailableError):
        return 503, type(exc).__name__, str(exc), lift_field(str(exc))
    return classify_leyline(exc)


def error_content(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, kind, message, field = classify(exc)
    code = exc.code if isinstance(exc, GuardError) else None
    if isinstance(exc, ValidationError) and exc.errors():  # pydantic's type, as leyline serve
        code = str(exc.errors()[0].get("type", "invalid_value")).replace(".", "_")
    body = error_body(kind, message, field, code, status=status)
    return status, {"error": body.model_dump(mode="json")}
