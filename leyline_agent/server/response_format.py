"""``response_format``: ``text``, ``json_object`` and ``json_schema``, as OpenAI defines them.

- ``{"type": "text"}`` (or absent): no constraint.
- ``{"type": "json_object"}``: the answer is one JSON object (any keys).
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``:
  the answer is JSON valid under ``schema``. Properties the schema does not name are
  refused either way (xgrammar's strict mode, what vLLM and SGLang apply), so ``strict``
  changes nothing here.

Each becomes a ``GrammarSpec`` the embedded engine masks its sampling by
(``engine/grammar.py``). A shape OpenAI would refuse is a 400 naming the field; a schema
the grammar compiler cannot take is a 400 naming ``response_format.json_schema.schema``.
With ``tool_choice`` ``required`` or a named function the answer is a call, and the call's
own grammar applies instead.
"""

from __future__ import annotations

from typing import Any

from leyline_agent.engine import grammar_spec as gs
from leyline_agent.server.errors import RequestError

__all__ = ["response_grammar"]

SCHEMA_FIELD = "response_format.json_schema.schema"


def response_grammar(fmt: Any) -> gs.GrammarSpec | None:
    """The grammar of a request's ``response_format`` (None: unconstrained)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("must be an object with a 'type'", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return gs.GrammarSpec(((gs.json_object(),),), "response_format")
    if kind != "json_schema":
        raise RequestError(
            f"{kind!r} is not one of 'text', 'json_object', 'json_schema'", "response_format.type"
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError("json_schema needs an object", "response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise RequestError("a json_schema needs a name", "response_format.json_schema.name")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise RequestError("the schema must be a JSON object", SCHEMA_FIELD)
    _check_schema(schema)
    return gs.GrammarSpec(((gs.json_schema(schema),),), SCHEMA_FIELD)


def _check_schema(schema: dict[str, Any]) -> None:
    """Refuse a schema that is not a valid JSON Schema (its metaschema's verdict)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise RequestError(f"not a valid JSON Schema: {e.message}", SCHEMA_FIELD) from e
