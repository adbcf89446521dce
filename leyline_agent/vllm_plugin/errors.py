"""Every failure of a Leyline route on vLLM as ``{"error": {"type", "message", "field"}}``.

The same mapping as ``leyline serve`` (``leyline_agent/server/errors.py``), restated for the
errors this route can meet: a bad body 422 ``ValidationError`` (``UnsupportedModeError``
for a reserved mode), ``CacheMissError`` 409, ``ModelNotFoundError`` 404, another
``LeylineError`` 400 under its class name, ``RuntimeUnavailableError`` 503 (also: a setup
the plugin refuses, naming the setting), anything else 500 ``InternalError``. ``field`` is
the request field at fault; errors raised below carry it as their message's prefix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from leyline_agent.directives import RESERVED_MODES
from leyline_agent.errors import (
    CacheMissError,
    DirectiveError,
    LeylineError,
    RuntimeUnavailableError,
)
from leyline_agent.wire import ErrorBody

__all__ = ["ModelNotFoundError", "classify", "error_content", "field_path"]

_RESERVED = {m.value for m in RESERVED_MODES}
_FIELD = re.compile(r"^([A-Za-z_][\w-]*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)*): ")
_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


class ModelNotFoundError(DirectiveError):
    """The request names a model this server does not serve (404)."""


def _lift(message: str) -> str | None:
    m = _FIELD.match(message)
    return m.group(1) if m else None


def field_path(loc: Sequence[Any]) -> str:
    """``("directives", 0, "end")`` -> ``"directives[0].end"`` (union members left out)."""
    out = ""
    for part in loc:
        if isinstance(part, str) and (
            part in _TAGS or not part.isidentifier() or part[:1].isupper()
        ):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def classify(exc: BaseException) -> tuple[int, str, str, str | None]:
    if isinstance(exc, ValidationError):
        errs = exc.errors()
        parts, first, reserved = [], None, False
        for err in errs[:5]:
            path = field_path(err.get("loc", ()))
            first = first if first is not None else (path or None)
            parts.append(f"{path}: {err.get('msg', 'invalid')}" if path else err.get("msg", ""))
            is_mode = path == "mode" or path.endswith(".mode")
            reserved |= is_mode and str(err.get("input", "")).lower() in _RESERVED
        return (
            422,
            "UnsupportedModeError" if reserved else "ValidationError",
            "; ".join(parts),
            first,
        )
    if isinstance(exc, CacheMissError):
        return 409, "CacheMissError", str(exc), _lift(str(exc)) or "tokens"
    if isinstance(exc, ModelNotFoundError):
        return 404, "ModelNotFoundError", str(exc), "model"
    if isinstance(exc, RuntimeUnavailableError):
        return 503, type(exc).__name__, str(exc), _lift(str(exc))
    if isinstance(exc, LeylineError):
        return 400, type(exc).__name__, str(exc), _lift(str(exc))
    if isinstance(exc, ValueError):
        return 400, "ValueError", str(exc), _lift(str(exc))
    return 500, "InternalError", f"{type(exc).__name__}: {exc}", None


def error_content(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, kind, message, field = classify(exc)
    body = ErrorBody(type=kind, message=message, field=field)
    return status, {"error": body.model_dump(mode="json")}
