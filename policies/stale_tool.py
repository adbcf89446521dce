"""``StaleToolTruncation``: the paper's rule, with the knobs of observation masking.

Tool results older than the last ``keep`` tool turns get their content replaced by a short
stub. A tool turn is an assistant message with tool calls (all its calls age together).

Knobs (names follow Anthropic's ``clear_tool_uses`` and OpenHands' observation masking):
- ``keep``: tool turns whose results stay intact (>= 1: the newest results are never cut).
- ``placeholder``: the stub; ``{tool}`` is replaced by the tool name.
- ``exclude_tools``: tool names never stubbed.
- ``min_tokens``: results estimated under this many tokens are left alone.
- ``trigger_tokens``: act only when the context (less the results already elided) is
  estimated above this size.
- ``clear_inputs``: also replace the stubbed calls' arguments by ``"{}"``.
- ``clear_at_least``: act only when this many tokens would be cleared at once (batches
  edits, so the cache is disturbed less often); a result shorter than its stub clears none.
- ``count_tokens``: a ``str -> int`` callable; default ``estimate_tokens`` (chars / 4).
- ``observation_prefix``: also treat user messages opening with it (smolagents'
  ``"Observation:"``) as tool results of the assistant message before them
  (``policies/observations``); their stub keeps the prefix. Default None: off.

Idempotent, also in a pipeline: an elided result (a stub of this policy or of another one,
``Policy.elided``) is not a candidate and is not counted for ``trigger_tokens``, so a second
run finds nothing to clear, no more tokens to save and no larger context than the first.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from pydantic import Field

from leyline_agent.directives import MessageEdit
from leyline_agent.trajectory import Trajectory, estimate_tokens

from .base import Policy, SpliceKnobs, validate_knobs
from .observations import result_content

__all__ = ["StaleToolConfig", "StaleToolTruncation"]

EMPTY_ARGUMENTS = "{}"


class StaleToolConfig(SpliceKnobs):
    keep: int = Field(default=2, ge=1)
    placeholder: str = Field(default="[stale output of {tool} elided]", min_length=1)
    exclude_tools: tuple[str, ...] = ()
    min_tokens: int = Field(default=0, ge=0)
    trigger_tokens: int = Field(default=0, ge=0)
    clear_inputs: bool = False
    clear_at_least: int = Field(default=0, ge=0)
    count_tokens: Callable[[str], int] | None = None
    observation_prefix: str | None = Field(default=None, min_length=1)


class StaleToolTruncation(Policy):
    """Stub tool results older than the last ``keep`` tool turns."""

    name = "stale-tool"
    config_class = StaleToolConfig

    def __init__(self, keep: int = 2, **knobs: Any) -> None:
        self.config = validate_knobs(StaleToolConfig, self.name, {"keep": keep, **knobs})
        self._count = self.config.count_tokens or estimate_tokens

    def stub(self, tool: str) -> str:
        return self.config.placeholder.replace("{tool}", tool)

    def is_stub(self, text: str, tool: str) -> bool:
        return text == self.stub(tool)

    def _context_tokens(self, trajectory: Trajectory, elided: frozenset[int]) -> int:
        return trajectory.total_tokens(self._count) - sum(
            trajectory.tokens(i, self._count) for i in elided
        )

    def edits(self, trajectory: Trajectory) -> list[MessageEdit]:
        cfg = self.config
        trajectory = self.view(trajectory)
        elided = self.elided(trajectory)
        if cfg.trigger_tokens and self._context_tokens(trajectory, elided) <= cfg.trigger_tokens:
            return []
        stale = trajectory.tool_turns[: max(0, len(trajectory.tool_turns) - cfg.keep)]
        content_edits: list[MessageEdit] = []
        cleared_calls: dict[int, set[int]] = {}  # assistant index -> positions to clear
        saved = 0
        for turn in stale:
            for call in turn.calls:
                if call.result_index is None or call.name in cfg.exclude_tools:
                    continue
                if call.result_index in elided:
                    # Already stubbed (by this policy or another one in the pipeline): leave
                    # the call alone, inputs included. They were cleared on the pass that
                    # stubbed it if that policy asked for it; clearing them now would make a
                    # second run change what the first one produced.
                    continue
                stub = self.stub(call.name)
                size = self._count(trajectory.text(call.result_index))
                if size < cfg.min_tokens:
                    continue
                saved += max(0, size - self._count(stub))  # a longer stub clears nothing
                content_edits.append(
                    MessageEdit(
                        index=call.result_index,
                        content=result_content(trajectory, call.result_index, stub),
                        policy=self.name,
                        **cfg.splice(),
                        reason=f"result of {call.name} ({call.id}) from tool turn {call.turn} is stale",
                    )
                )
                if call.position >= 0:  # an observation's call has no arguments to clear
                    cleared_calls.setdefault(call.message_index, set()).add(call.position)
        input_edits = self._input_edits(trajectory, cleared_calls) if cfg.clear_inputs else []
        saved += sum(_arg_savings(trajectory, e, self._count) for e in input_edits)
        if not content_edits and not input_edits:
            return []
        if cfg.clear_at_least and saved < cfg.clear_at_least:
            return []
        return sorted(content_edits + input_edits, key=lambda e: e.index)

    def _input_edits(
        self, trajectory: Trajectory, cleared: dict[int, set[int]]
    ) -> list[MessageEdit]:
        out = []
        for index, positions in sorted(cleared.items()):
            calls = copy.deepcopy(trajectory.messages[index]["tool_calls"])
            changed = False
            for j in positions:
                if calls[j]["function"]["arguments"] != EMPTY_ARGUMENTS:
                    calls[j]["function"]["arguments"] = EMPTY_ARGUMENTS
                    changed = True
            if changed:
                out.append(
                    MessageEdit(
                        index=index,
                        tool_calls=calls,
                        policy=self.name,
                        **self.config.splice(),
                        reason="arguments of stale tool calls cleared",
                    )
                )
        return out


def _arg_savings(trajectory: Trajectory, edit: MessageEdit, count: Callable[[str], int]) -> int:
    before = trajectory.messages[edit.index]["tool_calls"]
    after = edit.tool_calls or []
    return sum(
        max(0, count(b["function"]["arguments"]) - count(a["function"]["arguments"]))
        for b, a in zip(before, after, strict=True)
    )
