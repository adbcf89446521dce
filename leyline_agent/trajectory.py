"""An OpenAI-style message list, validated, with turns and tool-call/result pairing resolved.

``Trajectory.parse(messages)`` checks every message (role, content, tool calls, tool results)
and raises ``TrajectoryError`` naming ``messages[i].<field>`` at the first fault. It works on
a deep copy: the caller's list is never modified, and nothing a policy does to a
trajectory's messages reaches the caller.

Vocabulary:
- assistant turn: every assistant message starts one; ``turn_of[i]`` is the turn message
  ``i`` belongs to (-1 before the first assistant message).
- tool turn: an assistant message with tool calls, plus the tool results answering them.
- a tool result pairs with the earlier, not yet answered call whose id it names.

Token counts are estimates: without a tokenizer ``estimate_tokens`` counts ``ceil(chars/4)``
(about right for English and code under BPE vocabularies); policies accept a
``count_tokens`` callable for exact counts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from leyline_agent.edits import MessageEdit
from leyline_agent.errors import TrajectoryError

__all__ = [
    "ROLES",
    "Role",
    "ToolCall",
    "ToolTurn",
    "Trajectory",
    "apply_edit",
    "apply_edits",
    "call_ids",
    "edited_in_place",
    "estimate_tokens",
    "message_text",
]

# ``developer`` is OpenAI's newer name of ``system``; the chat template renders it as one.
Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES = frozenset(get_args(Role))

TokenCounter = Callable[[str], int]


def estimate_tokens(text: str) -> int:
    """Token estimate without a tokenizer: ceil(len(text) / 4)."""
    return (len(text) + 3) // 4


def message_text(message: Mapping[str, Any]) -> str:
    """The text of a message's content: a string, or the text parts of a content list."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))


def call_ids(message: Mapping[str, Any]) -> list[Any]:
    """The ids of a message's tool calls, in order (``[]`` without calls)."""
    return [c.get("id") for c in message.get("tool_calls") or []]


def edited_in_place(old: Mapping[str, Any], new: Mapping[str, Any], *, user: bool = False) -> bool:
    """``new`` is ``old`` with its content (or its calls' arguments) changed, not another
    message: a tool result answering the same call, an assistant turn with the same calls,
    or (``user``: the caller has proof that the sender holds this conversation) a user
    message. The server's conversation matching and the agent-side session both decide
    with this one rule, so a session the client keeps is one the server can match."""
    if old.get("role") != new.get("role"):
        return False
    if old["role"] == "user":
        return user
    if old["role"] == "tool":
        return bool(old.get("tool_call_id")) and old.get("tool_call_id") == new.get("tool_call_id")
    if old["role"] == "assistant":
        ids = call_ids(old)
        if not ids or None in ids or ids != call_ids(new):
            return False
        names = [c["function"]["name"] for c in old["tool_calls"]]
        return names == [c["function"]["name"] for c in new["tool_calls"]]
    return False


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    message_index: int  # the assistant message holding the call
    position: int  # index in that message's tool_calls
    turn: int  # assistant turn number
    result_index: int | None  # the tool message answering it, None while pending


@dataclass(frozen=True, slots=True)
class ToolTurn:
    turn: int
    assistant_index: int
    calls: tuple[ToolCall, ...]

    @property
    def result_indices(self) -> tuple[int, ...]:
        return tuple(c.result_index for c in self.calls if c.result_index is not None)


@dataclass(frozen=True, slots=True)
class Trajectory:
    """A validated message list (deep-copied) and its turn structure. Build with ``parse``."""

    messages: tuple[dict[str, Any], ...]
    turn_of: tuple[int, ...]
    tool_turns: tuple[ToolTurn, ...]
    calls: Mapping[str, ToolCall]  # by call id
    result_of: Mapping[int, ToolCall]  # tool message index -> the call it answers

    def __len__(self) -> int:
        return len(self.messages)

    @property
    def assistant_indices(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.messages) if m["role"] == "assistant")

    def text(self, index: int) -> str:
        return message_text(self.messages[index])

    def tokens(self, index: int, count: TokenCounter | None = None) -> int:
        """Estimated tokens of one message: its text plus its tool calls' names and arguments."""
        count = count or estimate_tokens
        msg = self.messages[index]
        n = count(self.text(index))
        for tc in msg.get("tool_calls") or ():
            fn = tc["function"]
            n += count(fn["name"]) + count(fn["arguments"])
        return n

    def total_tokens(self, count: TokenCounter | None = None) -> int:
        return sum(self.tokens(i, count) for i in range(len(self.messages)))

    @classmethod
    def parse(cls, messages: Any) -> Trajectory:
        """Validate ``messages`` and resolve turns and tool-call pairing (input untouched)."""
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise TrajectoryError(
                f"messages: expected a list of message objects, got {type(messages).__name__}"
            )
        msgs = tuple(copy.deepcopy(list(messages)))
        turn_of: list[int] = []
        turn = -1
        calls: dict[str, ToolCall] = {}
        pending: dict[str, ToolCall] = {}
        result_of: dict[int, ToolCall] = {}
        turn_calls: list[tuple[int, int, list[str]]] = []  # (turn, assistant index, call ids)
        for i, msg in enumerate(msgs):
            role = _check_message(msg, i)
            if role == "assistant":
                turn += 1
                ids = []
                for j, tc in enumerate(msg.get("tool_calls") or ()):
                    cid = tc["id"]
                    if cid in calls:
                        first = calls[cid]
                        raise TrajectoryError(
                            f"messages[{i}].tool_calls[{j}].id: {cid!r} is already used by "
                            f"messages[{first.message_index}].tool_calls[{first.position}]"
                        )
                    call = ToolCall(
                        cid, tc["function"]["name"], tc["function"]["arguments"], i, j, turn, None
                    )
                    calls[cid] = pending[cid] = call
                    ids.append(cid)
                if ids:
                    turn_calls.append((turn, i, ids))
            elif role == "tool":
                cid = msg["tool_call_id"]
                if cid not in calls:
                    raise TrajectoryError(
                        f"messages[{i}].tool_call_id: {cid!r} matches no earlier assistant tool call"
                    )
                if cid not in pending:
                    raise TrajectoryError(
                        f"messages[{i}].tool_call_id: call {cid!r} was already answered by "
                        f"messages[{calls[cid].result_index}]"
                    )
                call = pending.pop(cid)
                call = ToolCall(
                    call.id,
                    call.name,
                    call.arguments,
                    call.message_index,
                    call.position,
                    call.turn,
                    i,
                )
                calls[cid] = call
                result_of[i] = call
            turn_of.append(turn)
        tool_turns = tuple(ToolTurn(t, a, tuple(calls[c] for c in ids)) for t, a, ids in turn_calls)
        return cls(msgs, tuple(turn_of), tool_turns, calls, result_of)


def _check_message(msg: Any, i: int) -> str:
    where = f"messages[{i}]"
    if not isinstance(msg, Mapping):
        raise TrajectoryError(f"{where}: expected a message object, got {type(msg).__name__}")
    if "role" not in msg:
        raise TrajectoryError(f"{where}.role: missing")
    role = msg["role"]
    if not isinstance(role, str) or role not in ROLES:
        raise TrajectoryError(f"{where}.role: {role!r} is not one of {sorted(ROLES)}")
    has_calls = bool(msg.get("tool_calls"))
    if role == "assistant":
        if "tool_calls" in msg and msg["tool_calls"] is not None:
            _check_tool_calls(msg["tool_calls"], where)
        if msg.get("content") is None and not has_calls and msg.get("refusal") is None:
            raise TrajectoryError(
                f"{where}.content: an assistant message needs content or tool_calls"
            )
        if msg.get("content") is not None:
            _check_content(msg["content"], where)
        return role
    if msg.get("tool_calls"):
        raise TrajectoryError(f"{where}.tool_calls: only assistant messages carry tool calls")
    if "content" not in msg or msg["content"] is None:
        raise TrajectoryError(f"{where}.content: missing (a {role} message needs content)")
    _check_content(msg["content"], where)
    if role == "tool":
        cid = msg.get("tool_call_id")
        if not isinstance(cid, str) or not cid:
            raise TrajectoryError(
                f"{where}.tool_call_id: missing (a tool result must name its call)"
            )
    return role


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise TrajectoryError(
            f"{where}.content: expected a string or a list of content parts, got {type(content).__name__}"
        )
    for k, part in enumerate(content):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise TrajectoryError(f"{where}.content[{k}]: expected a content part with a 'type'")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise TrajectoryError(f"{where}.content[{k}].text: expected a string")


def _check_tool_calls(tool_calls: Any, where: str) -> None:
    if not isinstance(tool_calls, list):
        raise TrajectoryError(
            f"{where}.tool_calls: expected a list, got {type(tool_calls).__name__}"
        )
    for j, tc in enumerate(tool_calls):
        w = f"{where}.tool_calls[{j}]"
        if not isinstance(tc, Mapping):
            raise TrajectoryError(f"{w}: expected a tool call object")
        if not isinstance(tc.get("id"), str) or not tc["id"]:
            raise TrajectoryError(f"{w}.id: missing (a tool call needs a non-empty string id)")
        if tc.get("type", "function") != "function":
            raise TrajectoryError(f"{w}.type: {tc.get('type')!r} is not 'function'")
        fn = tc.get("function")
        if not isinstance(fn, Mapping):
            raise TrajectoryError(f"{w}.function: missing")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise TrajectoryError(f"{w}.function.name: missing")
        if not isinstance(fn.get("arguments"), str):
            raise TrajectoryError(
                f"{w}.function.arguments: expected a JSON string, got {type(fn.get('arguments')).__name__}"
            )


def apply_edit(message: Mapping[str, Any], edit: MessageEdit) -> dict[str, Any]:
    """A new message with ``edit`` applied (content and/or tool calls replaced)."""
    out = copy.deepcopy(dict(message))
    if edit.content is not None:
        out["content"] = edit.content
    if edit.tool_calls is not None:
        out["tool_calls"] = copy.deepcopy(edit.tool_calls)
    return out


def apply_edits(
    messages: Sequence[Mapping[str, Any]], edits: Sequence[MessageEdit]
) -> list[dict[str, Any]]:
    """A new list with every edit applied in order (later edits of one message win)."""
    out = [copy.deepcopy(dict(m)) for m in messages]
    for k, e in enumerate(edits):
        if e.index >= len(out):
            raise TrajectoryError(
                f"edits[{k}].index: {e.index} is past the end of the trajectory ({len(out)} messages)"
            )
        out[e.index] = apply_edit(out[e.index], e)
    return out
