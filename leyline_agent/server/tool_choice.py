"""``tool_choice``: ``auto``, ``none``, ``required`` and a named function.

- ``auto``: the model decides; a well-formed call in its answer becomes ``tool_calls``.
- ``none``: the tools are still rendered into the prompt (so the prompt, and its cache, is
  the same whatever the choice: an agent that alternates choices keeps its cache hits), but
  the answer is never parsed for calls: it is all ``content``.
- ``required``: the answer is forced to open with the format's call tag (Hermes:
  ``<tool_call>\\n``, appended after the generation prompt as if the model had written it),
  and the rest is constrained by a grammar (``grammar``): one call of one of the tools, its
  arguments valid under that tool's ``parameters`` schema, then the call's close.
- ``{"type": "function", "function": {"name": F}}``: the answer is forced to open with the
  call of ``F`` up to its arguments (Hermes: ``<tool_call>\\n{"name": "F", "arguments": ``);
  the grammar constrains the arguments to ``F``'s schema and closes the call.

The format is the served checkpoint's (``families.tool_format``). The forced text is part
of the answer (it is parsed with the rest). The embedded engine masks its sampling by the
grammar (``engine/grammar.py``), so the call always parses; if an answer still holds no
well-formed call (``max_tokens`` cut it short, or an engine without grammars served it), the
request fails with 422 ``ToolChoiceNotMetError`` (``param`` ``tool_choice``), never a reply
that silently ignores the choice. ``F`` must be one of ``tools``, else 400; a format whose
arguments are not JSON cannot be constrained: 400 naming ``tool_choice``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from leyline_agent.engine import grammar_spec as gs
from leyline_agent.families import HERMES, ToolFormat, tool_format
from leyline_agent.server.errors import RequestError
from leyline_agent.server.tool_calls import ParsedOutput, parse_tool_calls

__all__ = [
    "ToolChoice",
    "ToolChoiceNotMetError",
    "check_met",
    "parse_answer",
    "parse_tool_choice",
    "served_format",
]


def served_format(engine: Any) -> ToolFormat:
    """The tool-call format of the served engine's checkpoint (Hermes when unknown)."""
    model_type = getattr(getattr(engine, "config", None), "model_type", None)
    template = getattr(getattr(engine, "tokenizer", None), "chat_template", None)
    return tool_format(model_type, template if isinstance(template, str) else None)


class ToolChoiceNotMetError(RequestError):
    """The model's answer does not call a tool as ``tool_choice`` requires."""

    status = 422


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "function"]
    name: str | None = None  # the function, for mode "function"

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"

    def forced_prefix(self, fmt: ToolFormat = HERMES) -> str:
        """The text the answer is forced to start with ("" for auto and none)."""
        if self.mode == "required":
            return fmt.open_tag
        if self.mode == "function":
            assert self.name is not None
            return fmt.call_head(self.name)
        return ""

    def grammar(
        self, tools: list[dict[str, Any]] | None, fmt: ToolFormat = HERMES
    ) -> gs.GrammarSpec | None:
        """What the answer must match after ``forced_prefix`` (None for auto and none)."""
        if self.mode not in ("required", "function") or not tools:
            return None
        if fmt.args_open is None:
            raise RequestError(
                f"the served model's tool-call format ({fmt.name}) does not write arguments "
                "as JSON, so a call cannot be forced; use 'auto'",
                "tool_choice",
            )
        by_name = {t["function"]["name"]: t["function"] for t in tools}
        close = gs.text(fmt.call_close)
        if self.mode == "function":
            assert self.name is not None
            return gs.GrammarSpec(((_arguments(by_name[self.name]), close),), "tool_choice")
        alts = tuple(
            (gs.text(fmt.call_head(name)[len(fmt.open_tag) :]), _arguments(f), close)
            for name, f in by_name.items()
        )
        return gs.GrammarSpec(alts, "tool_choice")


def _arguments(function: dict[str, Any]) -> gs.GrammarPart:
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    return gs.json_schema(schema)


def parse_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """The request's ``tool_choice`` (OpenAI's default: auto with tools, none without)."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("auto", "none"):
        return ToolChoice(choice)
    if choice == "required":
        if not tools:
            raise RequestError("'required' needs at least one tool in 'tools'", "tool_choice")
        return ToolChoice("required")
    if isinstance(choice, str):
        raise RequestError(
            f"{choice!r} is not one of 'auto', 'none', 'required' or a named function",
            "tool_choice",
        )
    if choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise RequestError(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    name = choice["function"].get("name")
    names = [t["function"]["name"] for t in tools or []]
    if not isinstance(name, str) or name not in names:
        raise RequestError(
            f"{name!r} is not one of the request's tools {names}", "tool_choice.function.name"
        )
    return ToolChoice("function", name)


def check_met(choice: ToolChoice, calls: list[dict[str, Any]], text: str) -> None:
    """Raise ``ToolChoiceNotMetError`` if ``calls`` (parsed from ``text``) miss the choice."""
    if choice.mode == "required" and not calls:
        raise ToolChoiceNotMetError(
            f"tool_choice is 'required' but the model's answer holds no well-formed tool "
            f"call: {text[:200]!r}",
            "tool_choice",
        )
    if choice.mode == "function" and not any(c["function"]["name"] == choice.name for c in calls):
        raise ToolChoiceNotMetError(
            f"tool_choice names {choice.name!r} but the model's answer holds no well-formed "
            f"call of it: {text[:200]!r}",
            "tool_choice",
        )


def parse_answer(choice: ToolChoice, text: str, fmt: ToolFormat = HERMES) -> ParsedOutput:
    """The answer ``text`` (what the model wrote after the forced prefix) as content and
    calls; raises ``ToolChoiceNotMetError`` if it misses a ``required``/named choice."""
    full = choice.forced_prefix(fmt) + text
    parsed = parse_tool_calls(full, fmt)
    check_met(choice, parsed.tool_calls, full)
    return parsed
