"""What a constrained answer must match, as plain data (torch-free, xgrammar-free).

A ``GrammarSpec`` is one or more ``alternatives``; each is a sequence of ``GrammarPart``s
the answer writes one after the other: a fixed ``text``, a value valid under a JSON schema
(``json_schema``, the schema as a JSON string), or any JSON object (``json_object``). That
covers what the server asks for:

- ``response_format`` ``json_schema``: one alternative, one schema part;
- ``response_format`` ``json_object``: one alternative, one ``json_object`` part;
- a tool call: per tool, the family's call wrapper as text around the tool's parameters'
  schema (``server/tool_choice.py`` writes them); ``required`` is the union over the tools.

The server builds specs without importing the engine's dependencies; the engine compiles
them (``engine/grammar.py``). Frozen and hashable: the compiled grammar is cached by spec.
``field`` names the request field a spec came from, so a schema the compiler refuses is a
400 naming that field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["GrammarPart", "GrammarSpec", "json_object", "json_schema", "text"]

PartKind = Literal["text", "json_schema", "json_object"]


@dataclass(frozen=True, slots=True)
class GrammarPart:
    kind: PartKind
    value: str = ""  # the literal text, or the schema as canonical JSON
    strict: bool = True  # json_schema: no properties the schema does not name


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    alternatives: tuple[tuple[GrammarPart, ...], ...]
    field: str  # the request field the constraint came from

    def __post_init__(self) -> None:
        if not self.alternatives or not all(self.alternatives):
            raise ValueError("a grammar needs at least one non-empty alternative")


def text(value: str) -> GrammarPart:
    return GrammarPart("text", value)


def json_schema(schema: dict[str, Any] | bool, strict: bool = True) -> GrammarPart:
    return GrammarPart("json_schema", json.dumps(schema, sort_keys=True), strict)


def json_object() -> GrammarPart:
    return GrammarPart("json_object")
