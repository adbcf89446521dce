"""Checks on the parsed JSON body that no field model can make: text that is not Unicode.

Python's ``json`` module accepts what strict JSON parsers refuse: an escaped lone surrogate
(``"abc\\ud800def"``: a string that cannot be encoded as UTF-8, which the tokenizer then
fails on) and the non-standard ``NaN`` / ``Infinity`` literals (and numbers such as
``1e400`` that overflow to infinity). ``check_json_text`` walks the whole body, iteratively
(a deeply nested body cannot exhaust the stack), and refuses the first such value with a
400 naming its path (``messages[0].content``), before any field is used.
"""

from __future__ import annotations

import math
import re
from typing import Any

from fastapi import Request

from leyline_agent.server.errors import RequestError

__all__ = ["check_json_body", "check_json_text"]

_SURROGATE = re.compile("[\ud800-\udfff]")
_NAME = re.compile(r"^[A-Za-z_]\w*$")


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    name = key if _NAME.match(key) else repr(key)
    return f"{path}.{name}" if path else name


def check_json_text(body: Any) -> None:
    """Raise ``RequestError`` naming the first lone surrogate or non-finite number."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise RequestError(
                    "contains a lone UTF-16 surrogate (\\ud800-\\udfff); text must be Unicode",
                    path or "body",
                )
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise RequestError(f"{value} is not a JSON number", path or "body")
        elif isinstance(value, dict):
            for key in value:
                if _SURROGATE.search(key):
                    raise RequestError("a key contains a lone UTF-16 surrogate", path or "body")
            stack.extend((_join(path, k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((_join(path, i), v) for i, v in reversed(list(enumerate(value))))


async def check_json_body(request: Request) -> None:
    """Route dependency: check the body FastAPI parsed (``request.json()`` is cached)."""
    if request.method not in ("POST", "PUT", "PATCH"):
        return
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # not JSON: the route's own validation says so
        return
    check_json_text(body)
