"""``clear_thinking`` (Anthropic's ``clear_thinking_20251015``): earlier turns lose their thinking.

A policy over the served messages: in every assistant message but the newest ``keep`` that
hold thinking, the ``<think>...</think>`` spans of its content are removed (with the
whitespace that followed them). It is a content edit of the messages the server cached, so
the turn's ``context_management`` directive splices it like any other edit: the rows of the
thinking go, the rest of the cache stays. Idempotent: a cleared message has no span left.

Thinking a client sends in ``reasoning_content`` is left as it is (this policy edits content
only); the chat templates Leyline serves do not render that key.
"""

from __future__ import annotations

import re
from typing import ClassVar

from leyline_agent.directives import MessageEdit
from leyline_agent.policies import Policy
from leyline_agent.trajectory import Trajectory

__all__ = ["THINK_SPAN", "ClearThinking"]

THINK_SPAN = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


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
            and THINK_SPAN.search(m["content"])
        ]

    def edits(self, trajectory: Trajectory) -> list[MessageEdit]:
        if self.keep is None:
            return []
        turns = self.thinking_turns(trajectory)
        old = turns[: max(0, len(turns) - self.keep)]
        return [
            MessageEdit(
                index=i,
                content=THINK_SPAN.sub("", trajectory.messages[i]["content"]),
                policy=self.name,
                reason="thinking of an earlier turn cleared",
            )
            for i in old
        ]

    def serialize(self) -> dict[str, object]:
        return {"name": self.name, "keep": self.keep}
