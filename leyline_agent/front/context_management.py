"""``context_management`` and ``leyline`` on ``/v1/chat/completions``: the wire, checked.

``context_management`` is shaped like Anthropic's (``{"edits": [...]}``), with its meanings
and defaults:

- ``{"type": "clear_tool_uses"}`` (also ``clear_tool_uses_20250919``): once the prompt is over
  ``trigger`` (default ``{"type": "input_tokens", "value": 100000}``; a ``tool_uses`` trigger
  counts tool uses), the results of all but the newest ``keep`` tool uses (default
  ``{"type": "tool_uses", "value": 3}``) are replaced by a placeholder; ``clear_at_least``
  (``input_tokens``): act only when at least that many tokens are cleared at once;
  ``exclude_tools``: tool names never cleared; ``clear_tool_inputs: true``: the cleared calls'
  arguments become ``{}`` too. Leyline counts a tool use as one assistant tool turn (its
  parallel calls age together) and counts tokens with the served model's tokenizer.
  ``placeholder`` (Leyline's) sets the stub text.
- ``{"type": "clear_thinking_20251015"}`` (also ``clear_thinking``): the ``<think>`` spans of
  all but the newest ``keep`` assistant turns with thinking (default
  ``{"type": "thinking_turns", "value": 1}``; ``"all"`` keeps every one) are removed, a splice
  like any other edit (``clear_thinking``); ``applied_edits`` says how many turns it cleared,
  0 when there was nothing to clear. It may stand beside ``clear_tool_uses``, as Anthropic's
  clients send them.
- Leyline's own types run the built-in policies with their knobs (the same classes
  ``wrap_openai`` runs): ``{"type": "stale_tool", "keep": 2, ...}`` (``StaleToolTruncation``)
  and ``{"type": "failed_call", "after": 1, ...}`` (``FailedCallDetector``).

``leyline`` is Leyline's per-request override: ``{"client_edits": "amortize"|"forget"|"off"}``.

Everything is checked before anything runs: a bad field is a ``RequestError`` naming it
(``context_management.edits[0].keep.value``), and the cache is not touched. At most
``MAX_CONTEXT_EDITS`` edits (each runs over the whole prompt); their run has a time budget
(``turns.POLICY_BUDGET_S``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from leyline_agent.errors import RequestError
from leyline_agent.front.clear_thinking import ClearThinking
from leyline_agent.http_errors import field_path
from leyline_agent.policies import FailedCallDetector, Policy, StaleToolTruncation

__all__ = [
    "CLIENT_EDIT_MODES",
    "MAX_CONTEXT_EDITS",
    "ClearToolUses",
    "EditSpec",
    "LeylineOptions",
    "parse_context_management",
    "parse_leyline_options",
]

ClientEdits = Literal["amortize", "forget", "repair", "off"]
CLIENT_EDIT_MODES: tuple[str, ...] = ("amortize", "forget", "repair", "off")
ANTHROPIC_TRIGGER_TOKENS = 100_000  # Anthropic's default trigger
ANTHROPIC_KEEP = 3  # Anthropic's default keep (tool uses)
MAX_CONTEXT_EDITS = 16

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)


class InputTokens(BaseModel):
    model_config = _STRICT
    type: Literal["input_tokens"]
    value: int = Field(ge=0)


class ToolUses(BaseModel):
    model_config = _STRICT
    type: Literal["tool_uses"]
    value: int = Field(ge=0)


class KeepToolUses(BaseModel):
    model_config = _STRICT
    type: Literal["tool_uses"]
    value: int = Field(ge=1, description="Leyline never clears the newest tool use")


class ClearToolUses(BaseModel):
    """Anthropic's ``clear_tool_uses`` edit."""

    model_config = _STRICT
    type: Literal["clear_tool_uses", "clear_tool_uses_20250919"]
    trigger: InputTokens | ToolUses = InputTokens(
        type="input_tokens", value=ANTHROPIC_TRIGGER_TOKENS
    )
    keep: KeepToolUses = KeepToolUses(type="tool_uses", value=ANTHROPIC_KEEP)
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool = False
    placeholder: str | None = Field(default=None, min_length=1)


class ThinkingTurns(BaseModel):
    model_config = _STRICT
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class ClearThinkingEdit(BaseModel):
    """Anthropic's ``clear_thinking`` edit."""

    model_config = _STRICT
    type: Literal["clear_thinking", "clear_thinking_20251015"]
    keep: ThinkingTurns | Literal["all"] = ThinkingTurns(type="thinking_turns", value=1)


class LeylineOptions(BaseModel):
    model_config = _STRICT
    client_edits: ClientEdits | None = None
    # client_edits 'repair': the fraction of each tail recomputed (none: the server's default)
    repair_budget: float | None = Field(default=None, ge=0.0, le=1.0)


@dataclass(frozen=True, slots=True)
class EditSpec:
    """One checked edit: its ``type`` (as the client wrote it), the policy that runs it, and
    the trigger the policy does not know itself (``tool_uses``, or exact ``input_tokens``)."""

    type: str
    policy: Policy
    trigger_tokens: int = 0
    trigger_tool_uses: int = 0


_LEYLINE_TYPES: dict[str, type[Policy]] = {
    "stale_tool": StaleToolTruncation,
    "stale-tool": StaleToolTruncation,
    "failed_call": FailedCallDetector,
    "failed-call": FailedCallDetector,
}
_NOT_OVER_HTTP = frozenset({"count_tokens"})


def parse_leyline_options(raw: Any) -> LeylineOptions:
    if raw is None:
        return LeylineOptions()
    return _validate(LeylineOptions, raw, ("leyline",))


def parse_context_management(raw: Any, count_tokens: Callable[[str], int]) -> list[EditSpec]:
    """The checked edits of a ``context_management`` field (``[]`` for ``None``)."""
    if raw is None:
        return []
    if not isinstance(raw, dict):
        raise RequestError("must be an object with an 'edits' list", "context_management")
    unknown = sorted(set(raw) - {"edits"})
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}", f"context_management.{unknown[0]}")
    edits = raw.get("edits")
    if not isinstance(edits, list):
        raise RequestError("must be a list of edits", "context_management.edits")
    if len(edits) > MAX_CONTEXT_EDITS:
        raise RequestError(
            f"{len(edits)} edits; at most {MAX_CONTEXT_EDITS}", "context_management.edits"
        )
    return [_edit(e, k, count_tokens) for k, e in enumerate(edits)]


def _edit(raw: Any, k: int, count: Callable[[str], int]) -> EditSpec:
    where = ("context_management", "edits", k)
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise RequestError("each edit is an object with a 'type'", field_path((*where, "type")))
    kind = raw["type"]
    if kind.startswith("clear_tool_uses"):
        e = _validate(ClearToolUses, raw, where)
        knobs: dict[str, Any] = {
            "keep": e.keep.value,
            "exclude_tools": tuple(e.exclude_tools or ()),
            "clear_inputs": e.clear_tool_inputs,
            "clear_at_least": e.clear_at_least.value if e.clear_at_least else 0,
            "count_tokens": count,
        }
        if e.placeholder is not None:
            knobs["placeholder"] = e.placeholder
        tokens = e.trigger.value if isinstance(e.trigger, InputTokens) else 0
        uses = e.trigger.value if isinstance(e.trigger, ToolUses) else 0
        return EditSpec(kind, StaleToolTruncation(**knobs), tokens, uses)
    if kind.startswith("clear_thinking"):
        t = _validate(ClearThinkingEdit, raw, where)
        return EditSpec(kind, ClearThinking(None if t.keep == "all" else t.keep.value))
    cls = _LEYLINE_TYPES.get(kind)
    if cls is None:
        known = ["clear_tool_uses", "clear_thinking", "stale_tool", "failed_call"]
        raise RequestError(
            f"unknown edit type {kind!r}; known: {known}", field_path((*where, "type"))
        )
    knobs = {key: v for key, v in raw.items() if key != "type"}
    for key in knobs:
        if key in _NOT_OVER_HTTP:
            raise RequestError("cannot be set over HTTP", field_path((*where, key)))
    config_cls = cls.config_class
    assert config_cls is not None  # the built-in policies have one
    _validate(config_cls, knobs, where)
    if cls is StaleToolTruncation:
        knobs["count_tokens"] = count
    return EditSpec(kind, cls(**knobs))


def _validate[M: BaseModel](model: type[M], raw: Any, where: tuple[str | int, ...]) -> M:
    if not isinstance(raw, dict):
        raise RequestError("must be an object", field_path(where))
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = err.get("loc", ())
        raise RequestError(err.get("msg", "invalid value"), field_path((*where, *loc))) from e
