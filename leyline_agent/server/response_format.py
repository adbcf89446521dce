"""``response_format`` (``text``, ``json_object``, ``json_schema``, ``structural_tag``) and the
one grammar a chat answer is constrained by.

- ``{"type": "text"}`` or absent: no constraint.
- ``{"type": "json_object"}``: the answer is one JSON object (any keys).
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``:
  the answer is JSON valid under ``schema``. Properties the schema does not name are refused
  whatever ``strict`` says (xgrammar's strict mode, what vLLM and SGLang apply): a non-strict
  schema is a hint OpenAI may follow loosely, and a stricter answer is still a valid one.
- ``{"type": "structural_tag", "format": {...}}``: xgrammar's structural tag, as vLLM and
  SGLang take it.

Each becomes a ``GrammarSpec`` (``engine/grammar_spec.py``) the embedded engine masks its
sampling by. A shape OpenAI would refuse is a 400 naming the field; a schema the grammar
compiler refuses is a 400 naming ``response_format.json_schema.schema`` (checked by ``answer_grammar`` before the request edits or splices anything).
The JSON is written compactly (``", "`` and ``": "``, no other whitespace).
``max_tokens`` can cut it short: the answer is then incomplete JSON with ``finish_reason``
``length``, as OpenAI's would be.

``answer_grammar`` picks what constrains a chat answer: a ``tool_choice`` that forces a call
(its grammar, ``tool_choice.py``) wins over ``response_format`` (a forced call has no
content to format). On an engine that cannot constrain its sampling
(``supports_grammar`` false or missing), ``response_format`` is a 400 naming it, never a
silent plain answer; a forced call is then still forced by the prompt and checked
(``tool_choice.py``: a 422 if the answer holds no call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from leyline_agent.engine import grammar_spec as gs
from leyline_agent.server.errors import RequestError

if TYPE_CHECKING:
    from leyline_agent.server.worker import ServedEngine

__all__ = ["SCHEMA_FIELD", "answer_grammar", "response_grammar", "supports_grammar"]

SCHEMA_FIELD = "response_format.json_schema.schema"
_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def supports_grammar(engine: ServedEngine) -> bool:
    """Whether ``engine`` masks its sampling by ``SamplingParams.grammar``."""
    return bool(getattr(engine, "supports_grammar", False))


def response_grammar(fmt: Any) -> gs.GrammarSpec | None:
    """The grammar of a request's ``response_format`` (None: unconstrained)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("must be an object with a 'type'", "response_format")
    kind = fmt.get("type")
    if kind not in _TYPES:
        raise RequestError(f"{kind!r} is not one of {list(_TYPES)}", "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return gs.json_object("response_format")
    if kind == "structural_tag":
        tag = fmt.get("format")
        if not isinstance(tag, dict):
            raise RequestError("a structural tag needs a 'format' object", "response_format.format")
        return gs.structural_tag(tag, "response_format.format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError("must be an object", "response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise RequestError("must be a non-empty string", "response_format.json_schema.name")
    if "schema" not in spec:
        raise RequestError("a json_schema needs its schema", SCHEMA_FIELD)
    schema = spec["schema"]
    if not isinstance(schema, dict | bool):
        raise RequestError("must be a JSON schema (an object)", SCHEMA_FIELD)
    return gs.json_schema(schema, SCHEMA_FIELD)


def answer_grammar(
    engine: ServedEngine, call: gs.GrammarSpec | None, response_format: Any
) -> gs.GrammarSpec | None:
    """The grammar the answer is sampled under (see the module doc); ``call`` is the
    grammar of a forced tool call, if the request forces one."""
    fmt = response_grammar(response_format)  # checked even when a call wins
    grammar = call or fmt
    if grammar is None:
        return None
    if supports_grammar(engine):
        from leyline_agent.engine.grammar import check_spec  # xgrammar: the engine has it

        for spec in (call, fmt):
            if spec is not None:
                check_spec(spec)  # before anything is edited or spliced
        return grammar
    if call is not None:
        return None  # forced by the prompt and checked instead (tool_choice.py)
    raise RequestError(
        "this server's engine cannot constrain its sampling to a format; leave it unset or "
        "{'type': 'text'}",
        "response_format",
    )
