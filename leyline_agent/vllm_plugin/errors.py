"""Every failure of a Leyline route on vLLM as ``{"error": {"type", "message", "field", "code"}}``.

The mapping is ``directives.answers`` (the one ``leyline serve`` uses too), with what only
this route meets: a ``RuntimeUnavailableError`` (503) naming the setting at fault when its
message starts with it.
"""

from __future__ import annotations

from typing import Any

from leyline_agent.directives import answers
from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.http_errors import error_body, lift_field

__all__ = ["classify", "error_content"]


def classify(exc: BaseException) -> tuple[int, str, str, str | None]:
    if isinstance(exc, RuntimeUnavailableError):
        return 503, type(exc).__name__, str(exc), lift_field(str(exc))
    return answers.classify(exc)


def error_content(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, kind, message, field = classify(exc)
    body = error_body(kind, message, field, answers.error_code_of(exc, kind), status=status)
    return status, {"error": body.model_dump(mode="json")}
