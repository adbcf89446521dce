"""OpenAI wire format: requests of ``/v1/chat/completions``, ``/v1/completions`` and answers.

Requests: a field these models do not name is an OpenAI hint listed as ignored, or a 400
naming it (``request_fields``, before the model is read); known fields are validated
strictly (no string-to-number coercion) and a bad one is named in the error. Options the embedded
engine cannot honour (``n`` > 1, penalties, ``logit_bias``, ``echo``, ``best_of``,
a ``tool_choice`` that is not auto, none, required or one of the tools, a
``response_format`` the engine cannot constrain its sampling to) are refused with a 400
naming the field, never silently dropped.

Answers are built as plain dicts in exactly OpenAI's shape (``usage`` with
``prompt_tokens_details.cached_tokens``; ``null`` where OpenAI sends ``null``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from leyline_agent.chat_shapes import ChatMessage, ToolSpec

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "ToolSpec",
    "new_id",
    "usage",
]

_REQUEST = ConfigDict(frozen=True, extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _REQUEST

    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = _REQUEST

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(
        default=None,
        ge=0.0,
        le=2.0,
        description="sampling temperature; 0 and anything below 1e-5 (GREEDY_BELOW) is "
        "greedy decoding (a tinier one would overflow the logits); default 1",
    )
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, description="in [0, 2**63 - 1]")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's sampling options (``engine.params.SamplingParams``); top_k -1 or 0: no cut
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    # vLLM's answer constraints (``structured_outputs.structured_format``)
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: a forced call is exactly one call
    response_format: Any = None  # checked by ``response_format.response_grammar``
    # Leyline's server-side context editing (checked by ``context_management``):
    context_management: Any = None  # Anthropic's shape: {"edits": [...]}
    leyline: Any = None  # {"client_edits": "amortize" | "forget" | "off"}
    prompt_cache_key: str | None = None  # names the session where no header does
    # the prompt's rendering (``template_options``), as vLLM takes them
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "leyline"}
