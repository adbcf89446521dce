"""vLLM's ``structured_outputs`` (and its older ``guided_*`` fields) as a ``response_format``.

vLLM takes a constraint on the answer as ``structured_outputs: {"json" | "regex" | "choice" |
"grammar" | "json_object": ...}``, or as the fields ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``. Each becomes the ``response_format`` the embedded
engine already samples under (``response_format.py``, xgrammar): a JSON schema, a JSON
object, or a structural tag holding a regex, an EBNF grammar, or one of the choices as a
constant string. One constraint per request: two of them, or one beside ``response_format``,
is a 400 naming the second; an option the engine has no use for is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from leyline_agent.engine.grammar_spec import GrammarSpec
from leyline_agent.server.errors import RequestError
from leyline_agent.server.response_format import answer_grammar

__all__ = ["GUIDED", "completion_grammar", "structured_format"]

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _format(kind: str, value: Any, where: str) -> dict[str, Any]:
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, dict | bool):
            raise RequestError("must be a JSON schema (an object, or its JSON text)", where)
        return {"type": "json_schema", "json_schema": {"name": "structured", "schema": schema}}
    if kind == "json_object":
        if value is not True:
            raise RequestError("must be true", where)
        return {"type": "json_object"}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise RequestError("must be a non-empty list of strings", where)
        options = [{"type": "const_string", "value": c} for c in value]
        return {"type": "structural_tag", "format": {"type": "or", "elements": options}}
    if not isinstance(value, str) or not value:
        raise RequestError("must be a non-empty string", where)
    if kind == "regex":
        return {"type": "structural_tag", "format": {"type": "regex", "pattern": value}}
    return {"type": "structural_tag", "format": {"type": "grammar", "grammar": value}}


def structured_format(req: Any) -> dict[str, Any] | None:
    """The ``response_format`` ``req``'s ``structured_outputs`` / ``guided_*`` ask for (None:
    neither given); ``response_format`` itself is left to the caller."""
    asked: list[tuple[str, str, Any]] = []  # (kind, where, value)
    so = getattr(req, "structured_outputs", None)
    for key, value in (so or {}).items():
        if value is None:
            continue
        if key not in ("json", "json_object", "regex", "choice", "grammar"):
            raise RequestError(f"{key!r} is not supported", f"structured_outputs.{key}")
        asked.append((key, f"structured_outputs.{key}", value))
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            asked.append((kind, name, value))
    if not asked:
        return None
    if len(asked) > 1:
        raise RequestError("one constraint per request", asked[1][1])
    if getattr(req, "response_format", None) is not None:
        raise RequestError("give response_format or a structured output, not both", asked[0][1])
    kind, where, value = asked[0]
    try:
        return _format(kind, value, where)
    except json.JSONDecodeError as e:
        raise RequestError(f"not valid JSON ({e.msg})", where) from e


def completion_grammar(engine: Any, req: Any) -> GrammarSpec | None:
    """The grammar a ``/v1/completions`` request's structured output asks for (None: none),
    checked by the engine's compiler (``response_format.answer_grammar``)."""
    fmt = structured_format(req)
    return None if fmt is None else answer_grammar(engine, None, fmt)
