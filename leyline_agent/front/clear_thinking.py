"""``clear_thinking`` (Anthropic's ``clear_thinking_20251015``): earlier turns lose their thinking.

A policy over the served messages: in every assistant message but the newest ``keep`` that
hold thinking, the ``<think>...</think>`` spans of its content are removed (with the
whitespace that followed them: ``text_match.cut_spans``, one linear scan, as a client's text
may hold any number of unclosed tags). It is a content edit of the messages the server cached, so
the turn's ``context_management`` directive splices it like any other edit: the rows of the
thinking go, the rest of the cache stays. Idempotent: a cleared message has no span left.

Thinking a client sends in ``reasoning_content`` is left as it is (this policy edits content
only); the chat templates Leyline serves do not render that key.
"""

from __future__ import annotations

from typing import ClassVar

from leyline_agent.directives import MessageEdit
from leyline_agent.policies import Policy
from leyline_agent.text_match import cut_spans, has_span
from leyline_agent.trajectory import Trajectory

__all__ = ["THINK_CLOSE", "THINK_OPEN", "ClearThinking"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ClearThinking(Policy):
    name: ClassVar[str] = "clear-thinking"

    def __init__(self, keep: int | None = 1) -> None:
        """``keep``: the newest thinking turns left as they are (None: all, nothing cleared)."""
        self.keep = keep

    def thinking_turns(self, trajectory: Trajectory) -> list[int]:
        return [
            i
            for i, m in enumerate(trajectory.messages)
            if m.get("role") == "assistant"
            and isinstance(m.get("content"), str)
            and has_span(m["content"], THINK_OPEN, THINK_CLOSE)
        ]

    def edits(self, trajectory: Trajectory) -> list[MessageEdit]:
        if self.keep is None:
            return []
        turns = self.thinking_turns(trajectory)
        old = turns[: max(0, len(turns) - self.keep)]
        return [
            MessageEdit(
                index=i,
                content=cut_spans(trajectory.messages[i]["content"], THINK_OPEN, THINK_CLOSE),
                policy=self.name,
                reason="thinking of an earlier turn cleared",
            )
            for i in old
        ]

    def serialize(self) -> dict[str, object]:
        return {"name": self.name, "keep": self.keep}
