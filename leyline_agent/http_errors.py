"""How a Leyline route answers an error: ``(status, type, message, field)`` and the body.

One mapping for every HTTP side that speaks the Leyline routes (``leyline serve``'s
``server.errors`` adds what only FastAPI raises; the SGLang plugin's route uses this as it
is). No web framework here: pydantic's error lists are read as plain dicts.

======================================  ======  ============================================
raised                                  status  ``leyline_type``
======================================  ======  ============================================
an invalid request body (pydantic)      400     ``ValidationError`` (``UnsupportedModeError``
                                                for a reserved directive mode)
``ModelNotFoundError``                  404     ``ModelNotFoundError``
``CacheMissError``                      409     ``CacheMissError``
``RuntimeUnavailableError``             503     its class name
other ``LeylineError``                  400     its class name
other ``ValueError``                    400     ``ValueError``
anything else                           500     ``InternalError``
======================================  ======  ============================================

``field`` names the request field at fault, as a path: ``messages[2].role``,
``directives[0].end``. Errors raised below the routes carry it as the prefix of their
message (``"directives[0].end: ..."``); it is lifted from there. ``code`` is a short
snake_case reason (``error_code``).

On the wire the type column above is ``error.leyline_type`` (a Leyline client raises the
same class from it), and ``error.type`` is OpenAI's, from the status (``openai_type``):
``invalid_request_error`` (400, 404, 409, 413, 422 and other 4xx), ``authentication_error``
(401), ``permission_error`` (403), ``not_found_error`` (a 404 for a route or a stored object
that does not exist; an unknown model stays ``invalid_request_error`` with code
``model_not_found``, as OpenAI answers it), ``rate_limit_error`` (429), ``server_error``
(5xx). So an OpenAI SDK client sees the types it knows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from leyline_agent.edits import RESERVED_MODES
from leyline_agent.errors import (
    CacheMissError,
    LeylineError,
    ModelNotFoundError,
    RuntimeUnavailableError,
)
from leyline_agent.wire import ErrorBody

__all__ = [
    "classify",
    "error_body",
    "error_code",
    "field_path",
    "lift_field",
    "openai_type",
    "printable",
    "validation_answer",
]

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w-]*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)*): ")
_RESERVED = {m.value for m in RESERVED_MODES}
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


def lift_field(message: str) -> str | None:
    """The field path a message starts with (``"tokens[3]: ..."`` -> ``"tokens[3]"``)."""
    m = _FIELD_PREFIX.match(message)
    return m.group(1) if m else None


def validation_answer(errors: Sequence[dict[str, Any]]) -> tuple[int, str, str, str | None]:
    """The answer to pydantic's ``errors()`` of an invalid body."""
    parts, first, reserved = [], None, False
    for err in errors[:5]:
        path = field_path(err.get("loc", ()))
        first = first if first is not None else (path or None)
        parts.append(f"{path}: {err.get('msg', 'invalid')}" if path else err.get("msg", "invalid"))
        is_mode = path == "mode" or path.endswith(".mode")
        reserved |= is_mode and str(err.get("input", "")).lower() in _RESERVED
    type_ = "UnsupportedModeError" if reserved else "ValidationError"
    return 400, type_, "; ".join(parts), first


def classify(exc: BaseException) -> tuple[int, str, str, str | None]:
    """(status, type, message, field) of an error raised by a Leyline layer (see the table)."""
    if isinstance(exc, ModelNotFoundError):
        return 404, "ModelNotFoundError", str(exc), exc.field
    if isinstance(exc, CacheMissError):
        return 409, "CacheMissError", str(exc), lift_field(str(exc)) or "tokens"
    if isinstance(exc, RuntimeUnavailableError):  # a setting at fault leads its message
        return 503, type(exc).__name__, str(exc), lift_field(str(exc))
    if isinstance(exc, LeylineError):
        return 400, type(exc).__name__, str(exc), lift_field(str(exc))
    if isinstance(exc, ValueError):
        return 400, "ValueError", str(exc), lift_field(str(exc))
    return 500, "InternalError", f"{type(exc).__name__}: {exc}", None


def error_code(type_: str) -> str:
    """``CacheMissError`` -> ``cache_miss``, ``ModelNotFoundError`` -> ``model_not_found``."""
    if type_ in _CODES:
        return _CODES[type_]
    stem = type_.removesuffix("Error") or type_
    return re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower()


# The status a Leyline type is answered with, for a caller that does not pass it.
_STATUS_OF = {
    "AuthenticationError": 401,
    "ModelNotFoundError": 404,
    "NotFound": 404,
    "ResponseNotFoundError": 404,
    "MethodNotAllowed": 405,
    "CacheMissError": 409,
    "PayloadTooLargeError": 413,
    "RuntimeUnavailableError": 503,
    "QueueTimeoutError": 503,
    "InternalError": 500,
}
_INVALID_404 = frozenset({"ModelNotFoundError"})  # OpenAI: invalid_request_error there


def openai_type(status: int, leyline_type: str) -> str:
    """OpenAI's ``error.type`` for an answer of ``status`` (see the module doc)."""
    if status >= 500:
        return "server_error"
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status == 404 and leyline_type not in _INVALID_404:
        return "not_found_error"
    return "invalid_request_error"


def error_body(
    type_: str,
    message: str,
    field: str | None = None,
    code: str | None = None,
    *,
    status: int | None = None,
) -> ErrorBody:
    """OpenAI's error shape for a Leyline error of class name ``type_`` answered with
    ``status`` (by default the type's usual one, else 400): ``type`` OpenAI's
    (``openai_type``), ``leyline_type`` the class name; ``code`` defaults to the type's
    (``error_code``)."""
    answered = status if status is not None else _STATUS_OF.get(type_, 400)
    return ErrorBody(
        type=openai_type(answered, type_),
        leyline_type=type_,
        message=printable(message),
        field=field and printable(field),
        code=code or error_code(type_),
    )


def printable(text: str) -> str:
    """``text`` encodable as UTF-8: a lone surrogate quoted from the input becomes ``\\udXXX``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _union_tag(part: str) -> bool:
    """pydantic names the member of a union it tried (``list[int]``, ``str``, ``Model``)."""
    return part in _TYPE_TAGS or not part.isidentifier() or part[:1].isupper()
