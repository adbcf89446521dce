"""Model families: what Leyline knows about each ``config.model_type``, in one table.

A row says:

- ``mla``: DeepSeek's multi-head latent attention (the cache holds the latent ``c_kv`` and
  the post-RoPE ``k_pe``) or not (grouped-query attention: post-RoPE keys, plain values);
- ``rope_layout``, ``rope_partial``: how transformers' cache lays out the rotary pairs
  (``interleaved``: adjacent pairs; ``half``: ``(x_j, x_{j + d/2})``) and whether its default
  rope honours ``partial_rotary_factor`` (read from transformers 5.19's ``modeling_*.py``);
- ``sglang_rope``: the layout of SGLang 0.5.23's cache: ``half``, ``config`` (MLA: the
  config's ``rope_interleave`` decides) or None (no SGLang layout known);
- ``embedded``: the embedded engine serves it;
- ``chat``: the chat format of the checkpoints served for it: the special token that opens
  every message (message-form diffs cut there), the stop tokens, and the tool-call tags
  the server parses. Every family Leyline serves speaks ChatML with Hermes-style tool calls
  (the toy tokenizer's template, and Qwen's); a tokenizer without the boundary token gets
  whole-sequence diffs, which are exact too, only coarser.

No torch, no imports from the rest of the package: the engine, the kernels, the SGLang
plugin, the server and the reference oracles all read this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "CHATML_HERMES",
    "FAMILIES",
    "ChatFormat",
    "Family",
    "chat_format",
    "embedded_model_types",
    "family",
    "is_mla",
    "token_id",
]

Layout = Literal["interleaved", "half"]


@dataclass(frozen=True, slots=True)
class ChatFormat:
    message_boundary: str  # the special token that opens every message
    stop_tokens: tuple[str, ...]  # generation stops at any of them
    tool_call_open: str  # a tool call is written as open + JSON + close
    tool_call_close: str


CHATML_HERMES = ChatFormat(
    message_boundary="<|im_start|>",
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    tool_call_open="<tool_call>",
    tool_call_close="</tool_call>",
)


@dataclass(frozen=True, slots=True)
class Family:
    model_type: str
    rope_layout: Layout
    mla: bool = False
    rope_partial: bool = False
    sglang_rope: Literal["half", "config"] | None = None
    embedded: bool = False
    chat: ChatFormat = CHATML_HERMES


_ROWS = (
    Family("deepseek_v2", "interleaved", mla=True, sglang_rope="config", embedded=True),
    Family("deepseek_v3", "half", mla=True, sglang_rope="config", embedded=True),
    Family("llama", "half", sglang_rope="half", embedded=True),
    Family("qwen2", "half", sglang_rope="half", embedded=True),
    Family("qwen3", "half", sglang_rope="half", embedded=True),
    Family("mistral", "half", sglang_rope="half"),
    Family("qwen2_moe", "half", sglang_rope="half"),
    Family("qwen3_moe", "half", sglang_rope="half"),
    Family("glm", "interleaved", rope_partial=True),
    Family("glm4", "interleaved", rope_partial=True),
    Family("phi3", "half", rope_partial=True),
    Family("stablelm", "half", rope_partial=True),
    Family("gpt_neox", "half", rope_partial=True),
)
FAMILIES: dict[str, Family] = {f.model_type: f for f in _ROWS}


def family(model_type: str | None) -> Family | None:
    """The row of ``model_type``, or None for a model type Leyline does not know."""
    return FAMILIES.get(model_type) if model_type is not None else None


def is_mla(model_type: str | None) -> bool:
    row = family(model_type)
    return row is not None and row.mla


def chat_format(model_type: str | None) -> ChatFormat:
    """The chat format of ``model_type``'s family (ChatML + Hermes when it is not known)."""
    row = family(model_type)
    return row.chat if row is not None else CHATML_HERMES


def embedded_model_types() -> tuple[str, ...]:
    return tuple(f.model_type for f in _ROWS if f.embedded)


def token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` in ``tokenizer``'s vocabulary, or None where it has none."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(tid, int) or isinstance(tid, bool):
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    return None if unk is not None and tid == unk else tid
