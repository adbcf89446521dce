"""Every failure of a Leyline route on vLLM as ``{"error": {"type", "message", "field", "code"}}``.

The mapping is ``leyline_agent.http_errors`` (the one ``leyline serve`` and the SGLang route
use), with what only this route meets: a bad body is 422 ``ValidationError`` (vLLM's own
routes answer 422; ``UnsupportedModeError`` for a reserved mode), ``ModelNotFoundError`` 404,
and a ``RuntimeUnavailableError`` (503) names the setting at fault when its message starts
with it.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from leyline_agent.errors import DirectiveError, RuntimeUnavailableError
from leyline_agent.http_errors import classify as classify_leyline
from leyline_agent.http_errors import error_body, lift_field, validation_answer

__all__ = ["ModelNotFoundError", "classify", "error_content"]


class ModelNotFoundError(DirectiveError):
    """The request names a model this server does not serve (404)."""


def classify(exc: BaseException) -> tuple[int, str, str, str | None]:
    if isinstance(exc, ValidationError):
        _, kind, message, field = validation_answer(exc.errors())
        return 422, kind, message, field
    if isinstance(exc, ModelNotFoundError):
        return 404, "ModelNotFoundError", str(exc), "model"
    if isinstance(exc, RuntimeUnavailableError):
        return 503, type(exc).__name__, str(exc), lift_field(str(exc))
    return classify_leyline(exc)


def error_content(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, kind, message, field = classify(exc)
    return status, {"error": error_body(kind, message, field).model_dump(mode="json")}
