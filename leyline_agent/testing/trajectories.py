"""Build OpenAI-style tool-using trajectories for tests.

    t = TrajectoryBuilder(system="sys").user("fix it")
    t.tool_turn(("bash", {"cmd": "ls"}, "a.py b.py"))              # one call + its result
    t.tool_turn(("view", {"path": "a"}, "..."), ("view", {"path": "b"}, "..."))  # parallel
    t.text("done")
    messages = t.messages                                           # a fresh deep copy

Call ids are ``call_<n>`` in order. ``result_indices(turn)`` / ``call_index(turn)`` give the
positions of a tool turn's results / assistant message, computed while building.
"""

from __future__ import annotations

import copy
import json
from typing import Any

__all__ = ["TrajectoryBuilder"]


class TrajectoryBuilder:
    def __init__(self, system: str | None = "You are a careful agent.") -> None:
        self._messages: list[dict[str, Any]] = []
        self._turns: list[tuple[int, list[int]]] = []  # (assistant index, result indices)
        self._n = 0
        if system is not None:
            self._messages.append({"role": "system", "content": system})

    @property
    def messages(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self._messages)

    def user(self, content: str) -> TrajectoryBuilder:
        self._messages.append({"role": "user", "content": content})
        return self

    def text(self, content: str) -> TrajectoryBuilder:
        self._messages.append({"role": "assistant", "content": content})
        return self

    def tool_turn(
        self, *calls: tuple[str, dict[str, Any] | str, str | None], content: str | None = None
    ) -> TrajectoryBuilder:
        """An assistant message calling every ``(name, arguments, output)``; an output of
        None leaves that call pending (no result message)."""
        tool_calls = []
        for name, args, _ in calls:
            self._n += 1
            tool_calls.append(
                {
                    "id": f"call_{self._n}",
                    "type": "function",
                    "function": {
                        "name": name,
                        "arguments": args if isinstance(args, str) else json.dumps(args),
                    },
                }
            )
        self._messages.append({"role": "assistant", "content": content, "tool_calls": tool_calls})
        results = []
        for tc, (_, _, output) in zip(tool_calls, calls, strict=True):
            if output is not None:
                results.append(len(self._messages))
                self._messages.append({"role": "tool", "tool_call_id": tc["id"], "content": output})
        self._turns.append((len(self._messages) - len(results) - 1, results))
        return self

    def call_index(self, turn: int) -> int:
        return self._turns[turn][0]

    def result_indices(self, turn: int) -> list[int]:
        return list(self._turns[turn][1])

    @property
    def num_tool_turns(self) -> int:
        return len(self._turns)
