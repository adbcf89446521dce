"""What a constrained answer must match, as plain data (no torch, no xgrammar).

A ``GrammarSpec`` is one of:

- ``json_schema``: a JSON value valid under a schema (``response_format`` ``json_schema``);
  properties and items the schema does not name are refused (xgrammar's strict mode, what
  vLLM and SGLang apply);
- ``json_object``: any JSON object (``response_format`` ``json_object``);
- ``structural_tag``: xgrammar's structural tag, the format vLLM and SGLang also take as
  ``response_format`` ``structural_tag``: constant strings, JSON-schema values, sequences,
  alternatives and repetitions. A forced tool call is one (``server/tool_choice.py``).

``value`` is the schema or the tag as compact JSON, keys in the request's order (a schema's
``properties`` order is the order the answer writes them in). ``field`` names the request field the spec came from: a schema the compiler
refuses is a 400 naming it. The server builds specs; the engine compiles them
(``engine/grammar.py``) and masks its sampling by them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["GrammarKind", "GrammarSpec", "json_object", "json_schema", "structural_tag"]

GrammarKind = Literal["json_schema", "json_object", "structural_tag"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: GrammarKind
    value: str  # compact JSON of the schema or the structural tag ("" for json_object)
    field: str  # the request field it came from


def _compact(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def json_schema(schema: dict[str, Any] | bool, field: str) -> GrammarSpec:
    return GrammarSpec("json_schema", _compact(schema), field)


def json_object(field: str) -> GrammarSpec:
    return GrammarSpec("json_object", "", field)


def structural_tag(fmt: dict[str, Any], field: str) -> GrammarSpec:
    """A structural tag whose top-level ``format`` is ``fmt``."""
    return GrammarSpec(
        "structural_tag", _compact({"type": "structural_tag", "format": fmt}), field
    )
