"""``tool_choice``: ``auto``, ``none``, ``required`` and a named function.

- ``auto``: the model decides; a well-formed call in its answer becomes ``tool_calls``.
- ``none``: the tools are still rendered into the prompt (so the prompt, and its cache, is
  the same whatever the choice: an agent that alternates choices keeps its cache hits), but
  the answer is never parsed for calls: it is all ``content``.
- ``required``: the answer is forced to open with the family's tool-call tag (the tokens of
  ``<tool_call>\\n`` are appended after the generation prompt, as if the model had written
  them); the grammar (``grammar``) makes the rest one call of one of the tools, its
  arguments valid under that tool's ``parameters`` schema, then the call's close; with
  ``parallel_tool_calls`` (OpenAI's default) more calls may follow, each on a new line, if
  the model writes the next open tag itself (after a close and a newline, the stop token
  is as allowed as the tag: one call unless the model chooses more).
- ``{"type": "function", "function": {"name": F}}``: the answer is forced to open with
  ``<tool_call>\\n{"name": "F", "arguments": ``; the grammar makes the rest ``F``'s
  arguments, valid under its schema, and the close: exactly one call.

The grammar is a structural tag (``engine/grammar_spec.py``) the embedded engine masks its
sampling by (``engine/grammar.py``), so the call always parses, written compactly. A tool
without ``parameters`` takes ``{}``. The forced text is part of the answer (it is parsed with
the rest). An answer the token budget cut is what OpenAI answers: 200 with ``finish_reason``
``length`` (``tool_calls.ResponseStream``: the call cut mid-arguments is returned with what
was written, one cut before its name is dropped, never left in the content). If a finished
answer holds no well-formed call (an engine that cannot constrain its sampling served it:
then the prompt alone forces the call), the request fails with 422 ``ToolChoiceNotMetError``
(``param`` ``tool_choice``), never a reply that silently ignores the choice. ``F`` must be one of ``tools``, else 400; a tool
schema the grammar compiler refuses is a 400 naming ``tools``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from leyline_agent.engine import grammar_spec as gs
from leyline_agent.families import CHATML_HERMES, ChatFormat, ToolFormat
from leyline_agent.server.errors import RequestError
from leyline_agent.server.tool_calls import HERMES, ResponseStream

__all__ = [
    "ToolChoice",
    "ToolChoiceNotMetError",
    "check_met",
    "parse_tool_choice",
]


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

    def forced_prefix(self, fmt: ChatFormat = CHATML_HERMES) -> str:
        """The text the answer is forced to start with ("" for auto and none)."""
        if self.mode == "required":
            return fmt.tool_call_open + "\n"
        if self.mode == "function":
            return fmt.tool_call_open + "\n" + _call_head(self.name)
        return ""

    def grammar(
        self,
        tools: list[dict[str, Any]] | None,
        parallel: bool | None = None,
        fmt: ChatFormat = CHATML_HERMES,
    ) -> gs.GrammarSpec | None:
        """What the answer must match after ``forced_prefix`` (None for auto and none)."""
        if self.mode not in ("required", "function") or not tools:
            return None
        fns = {t["function"]["name"]: t["function"] for t in tools}
        close = _const("}\n" + fmt.tool_call_close)
        if self.mode == "function":
            assert self.name is not None
            return gs.structural_tag(_seq(_arguments(fns[self.name]), close), "tools")
        calls = [_seq(_const(_call_head(n)), _arguments(f), close) for n, f in fns.items()]
        one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        if parallel is False:
            return gs.structural_tag(one, "tools")
        # another call only if the model opens it: after a call's close and one optional
        # newline it chooses between the stop token and the open tag (never a newline that
        # the grammar would then have to turn into a call)
        more = {"type": "star", "content": _seq(_const("\n" + fmt.tool_call_open + "\n"), one)}
        end = {"type": "optional", "content": _const("\n")}
        return gs.structural_tag(_seq(one, more, end), "tools")


def _call_head(name: str | None) -> str:
    """A Hermes call up to its arguments, after the open tag's line."""
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _seq(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "json_schema", "json_schema": schema}


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


def check_met(
    choice: ToolChoice, calls: list[dict[str, Any]], text: str, truncated: bool = False
) -> None:
    """Raise ``ToolChoiceNotMetError`` if ``calls`` (parsed from ``text``) miss the choice;
    an answer the token budget cut (``truncated``) is answered as it is (``length``)."""
    if truncated:
        return
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


def answer_stream(
    choice: ToolChoice,
    tools: list[dict[str, Any]] | None,
    served: tuple[ToolFormat, bool],
    prefix: str = "",
) -> ResponseStream:
    """The parse of an answer under ``choice`` (``tool_calls.ResponseStream``): a forced call
    in Hermes (what the prompt and the grammar write), its forced opening already fed;
    otherwise the served format and reasoning (``served_format``), calls parsed unless the
    choice is none or there are no tools. ``prefix``: the prompt's tail."""
    if choice.mode in ("required", "function"):
        stream = ResponseStream(HERMES, tools=tools)
        stream.prime(choice.forced_prefix(CHATML_HERMES))
        return stream
    fmt, reasoning = served
    calls = fmt if tools is not None and choice.parses_calls else None
    return ResponseStream(calls, reasoning=reasoning, prefix=prefix, tools=tools)
