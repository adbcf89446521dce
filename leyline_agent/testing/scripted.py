"""Scripted models: canned assistant turns, for tests of agent-side logic.

    model = ScriptedModel([tool_turn("bash", {"cmd": "ls"}), text_turn("done")])
    reply = model(messages)          # the next canned turn (an assistant message dict)

A turn may also be a callable ``messages -> assistant message`` (to react to the prompt).
Every prompt is recorded in ``model.prompts``. Running out of turns raises ``ScriptExhausted``.
Tool-call ids are deterministic (``call_<turn>_<k>``) unless given. ``ReplayModel`` replays
a debug-gym-style script per conversation instead (``testing.stub_server`` serves either).
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ReplayModel", "ScriptExhausted", "ScriptedModel", "text_turn", "tool_turn"]

Turn = dict[str, Any] | Callable[[list[dict[str, Any]]], dict[str, Any]]


class ScriptExhausted(RuntimeError):
    """The script has no turn left for this prompt."""


def text_turn(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def tool_turn(
    name: str,
    arguments: dict[str, Any] | str | None = None,
    *more: tuple[str, dict[str, Any] | str],
    content: str | None = None,
    ids: Sequence[str] | None = None,
) -> dict[str, Any]:
    """An assistant turn calling ``name(arguments)`` (plus ``(name, arguments)`` pairs in ``more``)."""
    pairs = [(name, arguments or {}), *more]
    calls = []
    for k, (n, a) in enumerate(pairs):
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)},
        }
        if ids is not None:
            call["id"] = ids[k]
        calls.append(call)
    return {"role": "assistant", "content": content, "tool_calls": calls}


class ScriptedModel:
    def __init__(self, turns: Sequence[Turn], *, model_name: str = "scripted") -> None:
        self.turns = list(turns)
        self.model_name = model_name
        self.prompts: list[list[dict[str, Any]]] = []
        self._next = 0
        self._lock = threading.Lock()

    @property
    def remaining(self) -> int:
        return len(self.turns) - self._next

    def __call__(self, messages: Sequence[dict[str, Any]]) -> dict[str, Any]:
        with self._lock:
            if self._next >= len(self.turns):
                raise ScriptExhausted(
                    f"script has {len(self.turns)} turns; prompt {self._next + 1} has none"
                )
            k = self._next
            self._next += 1
            self.prompts.append(copy.deepcopy(list(messages)))
        turn = self.turns[k]
        reply = turn(list(messages)) if callable(turn) else copy.deepcopy(turn)
        for j, call in enumerate(reply.get("tool_calls") or ()):
            call.setdefault("id", f"call_{k}_{j}")
            call.setdefault("type", "function")
        return reply


class ReplayModel:
    """A debug-gym-style script, replayed for every conversation from its start.

    A turn is ``{"content": str | None, "tool": name, "arguments": {...}}``; the turn played
    is chosen by the number of assistant messages already in the prompt, so several
    episodes can share one server; past the end of the script the last turn repeats.
    Tool-call ids are ``call_<n>``, ``n`` counting the replies made so far.
    """

    def __init__(self, turns: Sequence[dict[str, Any]]) -> None:
        if not turns:
            raise ValueError("turns: a replay needs at least one turn")
        self.turns = list(turns)
        self._calls = 0
        self._lock = threading.Lock()

    def __call__(self, messages: Sequence[dict[str, Any]]) -> dict[str, Any]:
        with self._lock:
            n = self._calls
            self._calls += 1
        step = sum(1 for m in messages if m.get("role") == "assistant")
        turn = self.turns[min(step, len(self.turns) - 1)]
        reply: dict[str, Any] = {"role": "assistant", "content": turn.get("content")}
        if turn.get("tool"):
            args = json.dumps(turn.get("arguments", {}))
            reply["tool_calls"] = [
                {
                    "id": f"call_{n}",
                    "type": "function",
                    "function": {"name": turn["tool"], "arguments": args},
                }
            ]
        return reply
