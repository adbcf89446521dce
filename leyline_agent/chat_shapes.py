"""OpenAI's shapes of a chat message and of a tool, validated before anything renders them.

The chat routes and the message-form directive route of every Leyline front (``leyline
serve``, the vLLM plugin) check messages and tools with these models, so a malformed one is
refused with the same 400 naming the same field everywhere. Shape only: the raw dict is what
the chat template renders (``chat_input`` projects it first). Unknown keys are ignored (clients
send extras); known ones are strict (no string-to-number coercion).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ChatMessage", "ContentPart", "FunctionCall", "FunctionSpec", "ToolCall", "ToolSpec"]

_REQUEST = ConfigDict(frozen=True, extra="ignore", strict=True)


class FunctionSpec(BaseModel):
    model_config = _REQUEST

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = _REQUEST

    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionCall(BaseModel):
    model_config = _REQUEST

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any]


class ToolCall(BaseModel):
    model_config = _REQUEST

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = _REQUEST

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message, validated for shape only; the raw dict is what the template renders."""

    model_config = _REQUEST

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
