"""A chat request's schema work, off the event loop and bounded.

Turning a JSON schema into a grammar is CPU work that grows with the schema (xgrammar's
converter: about 0.3 s for one array nested 100 deep), and a request may carry many. Run in
an ``async`` handler it stalls every stream and ``/health``; unbounded, it holds a core for as
long as a client likes. So ``answer_constraints`` does it all off the loop (``offload``),
after the request's text was bounded by its length (``limits.check_text_bound``), within
bounds:

1. ``SchemaLimits``: at most ``max_tools`` tools and ``max_schema_bytes`` of schemas in all
   (tools' ``parameters`` and ``response_format``'s schema, as compact JSON), nesting at most
   ``MAX_SCHEMA_DEPTH`` deep, at most ``MAX_OPTIONAL_PROPERTIES`` optional properties per
   object (xgrammar's grammar for optional properties grows with their square: 600 take
   10 s to compile here) (``leyline serve --max-tools`` / ``--max-schema-bytes``);
2. every ``$ref`` points into the schema itself (``#...``): a remote or ``file:`` reference
   is a 400 naming it (the grammar compiler would leave it unconstrained);
3. every tool's schema is checked by the grammar compiler whatever ``tool_choice`` says
   (``tools[k].function.parameters``), where the engine constrains its sampling: a schema it
   refuses is refused under ``auto`` as under ``required``;
4. then ``tool_choice`` and ``response_format`` become the answer's grammar
   (``tool_choice.py``, ``response_format.py``).

The whole of it has ``deadline_s``; past it the request gets a 400 naming the field being
worked on, and the thread finishes its step in the background (a compiled schema is cached,
``engine/grammar.py``, so a repeat is free). The compile of the grammar itself happens on the
engine's side, under its own deadline (``engine/grammar.COMPILE_DEADLINE_S``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from leyline_agent.engine import grammar_spec as gs
from leyline_agent.http.offload import off_loop
from leyline_agent.server.errors import RequestError
from leyline_agent.server.response_format import SCHEMA_FIELD, answer_grammar, supports_grammar
from leyline_agent.server.tool_choice import ToolChoice, parse_tool_choice

if TYPE_CHECKING:
    from leyline_agent.server.worker import ServedEngine

__all__ = [
    "DEFAULT_MAX_SCHEMA_BYTES",
    "DEFAULT_MAX_TOOLS",
    "MAX_OPTIONAL_PROPERTIES",
    "MAX_SCHEMA_DEPTH",
    "SchemaLimits",
    "answer_constraints",
    "check_schema",
]

DEFAULT_MAX_TOOLS = 128  # OpenAI's own limit on a request's tools
DEFAULT_MAX_SCHEMA_BYTES = 256 << 10
MAX_SCHEMA_DEPTH = 32
MAX_OPTIONAL_PROPERTIES = 128
SCHEMA_DEADLINE_S = 5.0


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    max_tools: int = DEFAULT_MAX_TOOLS
    max_schema_bytes: int = DEFAULT_MAX_SCHEMA_BYTES
    deadline_s: float = SCHEMA_DEADLINE_S


@dataclass(frozen=True, slots=True)
class Constraints:
    """What ``answer_constraints`` decided: the parsed ``tool_choice``, the text the answer
    is forced to open with, and the grammar it is sampled under (None: free)."""

    choice: ToolChoice
    forced: str
    grammar: gs.GrammarSpec | None


def check_schema(schema: Any, field: str) -> int:
    """Walk ``schema`` (iteratively): nesting at most ``MAX_SCHEMA_DEPTH``, at most
    ``MAX_OPTIONAL_PROPERTIES`` optional properties per object, every ``$ref`` local; returns its compact JSON's size in bytes. ``RequestError`` naming the place."""
    stack: list[tuple[Any, str, int]] = [(schema, field, 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise RequestError(f"nests deeper than {MAX_SCHEMA_DEPTH} levels", where)
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
                raise RequestError(
                    f"{ref!r}: only local references ('#/...') are followed; a remote or "
                    "file reference would leave the answer unconstrained",
                    f"{where}.$ref",
                )
            props, required = node.get("properties"), node.get("required")
            if isinstance(props, dict) and len(props) > MAX_OPTIONAL_PROPERTIES:
                named = (
                    {r for r in required if isinstance(r, str)}
                    if isinstance(required, list)
                    else set()
                )
                optional = sum(1 for k in props if k not in named)
                if optional > MAX_OPTIONAL_PROPERTIES:
                    raise RequestError(
                        f"{optional} optional properties; at most {MAX_OPTIONAL_PROPERTIES} "
                        "per object (list the others in 'required')",
                        f"{where}.properties",
                    )
            stack.extend((v, f"{where}.{k}", depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(node))
    return len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode())


def _plan(
    engine: ServedEngine,
    tool_choice: Any,
    tools: list[dict[str, Any]] | None,
    parallel: bool | None,
    response_format: Any,
    limits: SchemaLimits,
    at: list[str],
) -> Constraints:
    """Steps 1-4 of the module doc; ``at[0]`` names the field being worked on."""
    schemas: list[tuple[Any, str]] = []
    if tools:
        if len(tools) > limits.max_tools:
            raise RequestError(f"{len(tools)} tools; at most {limits.max_tools}", "tools")
        schemas += [
            (t["function"].get("parameters") or {}, f"tools[{k}].function.parameters")
            for k, t in enumerate(tools)
        ]
    fmt_schema = _format_schema(response_format)
    if fmt_schema is not None:
        schemas.append((fmt_schema, SCHEMA_FIELD))
    total = 0
    for schema, field in schemas:
        at[0] = field
        total += check_schema(schema, field)
        if total > limits.max_schema_bytes:
            raise RequestError(f"the request's schemas pass {limits.max_schema_bytes} bytes", field)
    if tools and supports_grammar(engine):
        from leyline_agent.engine.grammar import check_spec  # xgrammar: the engine has it

        for schema, field in schemas[: len(tools)]:
            at[0] = field
            check_spec(gs.json_schema(schema, field))
    at[0] = "tool_choice"
    choice = parse_tool_choice(tool_choice, tools)
    forced = choice.forced_prefix() if tools is not None else ""
    call = choice.grammar(tools, parallel)
    at[0] = "response_format"
    return Constraints(choice, forced, answer_grammar(engine, call, response_format))


def _format_schema(fmt: Any) -> Any:
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if isinstance(spec, dict):
            return spec.get("schema")
    return None


async def answer_constraints(
    engine: ServedEngine,
    tool_choice: Any,
    tools: list[dict[str, Any]] | None,
    parallel: bool | None,
    response_format: Any,
    limits: SchemaLimits | None = None,
) -> Constraints:
    """The request's ``Constraints``, worked out on the schema threads (module doc)."""
    limits = limits or SchemaLimits()
    if not tools and response_format is None and tool_choice is None:
        return Constraints(parse_tool_choice(None, None), "", None)  # nothing to work on
    at = ["tools"]
    args = (engine, tool_choice, tools, parallel, response_format, limits, at)
    return await off_loop(_plan, *args, deadline_s=limits.deadline_s, field=lambda: at[0])
