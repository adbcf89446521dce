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
  every message (message-form diffs cut there), the stop tokens, and the tool-call tags a
  forced call opens with;
- ``tool_formats``, ``reasoning``: how its checkpoints write tool calls (``TOOL_FORMATS``,
  transformers response templates, chosen by the chat template's text: ``tool_format``)
  and whether they think first (``<think>...</think>``). Every family Leyline serves speaks ChatML with Hermes-style tool calls
  (the toy tokenizer's template, and Qwen's); a tokenizer without the boundary token gets
  whole-sequence diffs, which are exact too, only coarser.

No torch, no imports from the rest of the package: the engine, the kernels, the SGLang
plugin, the server and the reference oracles all read this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ASSISTANT_OPENERS",
    "CHATML_HERMES",
    "THINK_CLOSE",
    "THINK_OPEN",
    "TOOL_FORMATS",
    "ToolFormat",
    "FAMILIES",
    "ChatFormat",
    "Family",
    "chat_format",
    "embedded_model_types",
    "family",
    "is_mla",
    "reasons",
    "token_id",
    "tool_format",
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
class ToolFormat:
    """How a family's checkpoints write tool calls, as a transformers ``response_template``
    (``transformers.utils.chat_parsing``: fields with open/close delimiters and a content
    parser) that ``server/tool_calls.py`` runs; the server shapes what it returns into
    OpenAI's ``tool_calls``.

    ``marker``: a string whose presence in a tokenizer's chat template says it writes this
    format. ``tool_calls``: the template's ``tool_calls`` field (its value is a call as a
    dict with ``name`` and ``arguments`` or ``parameters``, or the body's text when it does
    not parse). ``open``/``close``: the text a malformed block is put back into the content
    with (exactly what the model wrote for Hermes; around the body for the others).
    ``ends_at_eos``: a call runs to the end of the answer (no close delimiter), else a block
    left open when generation stopped stays content. ``ignored``: literals around a group of
    calls, in no field (never content)."""

    name: str
    marker: str
    tool_calls: dict[str, Any]
    open: str
    close: str = ""
    ends_at_eos: bool = False
    ignored: tuple[str, ...] = ()


# What opens the assistant's answer in each chat format (where the parser starts).
ASSISTANT_OPENERS = (
    "<|im_start|>assistant\n",
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "<\uff5cAssistant\uff5c>",
)
# Reasoning families write their thinking first, between these (``reasoning_content``).
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# A call whose name the open delimiter captured (``function`` lets transformers cast the
# arguments by the tool's schema).
_NAMED_CALL = {"function": {"name": "{name}", "arguments": "{content}"}}
_JSON = {"allow_non_json": True, "strip": False}

TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat(  # Hermes / Qwen2.5 / Qwen3: <tool_call>{"name", "arguments"}</tool_call>
            "hermes",
            "<tool_call>",
            {"open": "<tool_call>", "close": "</tool_call>", "content": "json",
             "content_args": _JSON, "repeats": True},
            open="<tool_call>",
            close="</tool_call>",
        ),
        ToolFormat(  # Llama 3.x: the whole answer is {"name", "parameters"} (; between calls)
            "llama3_json",
            "<|start_header_id|>",
            {"open_pattern": r"<\|python_tag\|>|\A(?=\s*\{)", "content": "text",
             "content_args": {"strip": False}, "repeats": True},
            open="",
            ends_at_eos=True,
        ),
        ToolFormat(  # Qwen3-Coder: <tool_call><function=f><parameter=p>v</parameter>...
            "qwen3_xml",
            "<function=",
            {"open_pattern": r"<tool_call>\s*<function=(?P<name>[^>\n]+)>",
             "close_pattern": r"</function>\s*</tool_call>", "content": "xml-inline",
             "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>"},
             "repeats": True, "transform": _NAMED_CALL},
            open="<tool_call>",
            close="</tool_call>",
        ),
        ToolFormat(  # DeepSeek V3: <｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json ... ```
            "deepseek_v3",
            "<\uff5ctool\u2581calls\u2581begin\uff5c>",
            {"open_pattern": "<\uff5ctool\u2581call\u2581begin\uff5c>function<\uff5ctool\u2581sep\uff5c>"
             r"(?P<name>[^\n]+)\n```json\n",
             "close": "\n```<\uff5ctool\u2581call\u2581end\uff5c>",
             "content": "json", "content_args": _JSON, "repeats": True, "transform": _NAMED_CALL},
            open="<\uff5ctool\u2581call\u2581begin\uff5c>",
            close="<\uff5ctool\u2581call\u2581end\uff5c>",
            ignored=(
                "<\uff5ctool\u2581calls\u2581begin\uff5c>",
                "<\uff5ctool\u2581calls\u2581end\uff5c>",
            ),
        ),
    )
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Family:
    model_type: str
    rope_layout: Layout
    mla: bool = False
    rope_partial: bool = False
    sglang_rope: Literal["half", "config"] | None = None
    embedded: bool = False
    chat: ChatFormat = CHATML_HERMES
    tool_formats: tuple[str, ...] = ()  # tried in order (by ``marker``), then Hermes
    reasoning: bool = False  # answers open with <think>...</think> (``reasoning_content``)


_DS, _QWEN3 = ("deepseek_v3",), ("qwen3_xml",)
_ROWS = (
    Family("deepseek_v2", "interleaved", mla=True, sglang_rope="config", embedded=True,
           tool_formats=_DS),
    Family("deepseek_v3", "half", mla=True, sglang_rope="config", embedded=True,
           tool_formats=_DS, reasoning=True),
    Family("llama", "half", sglang_rope="half", embedded=True, tool_formats=("llama3_json",)),
    Family("qwen2", "half", sglang_rope="half", embedded=True),
    Family("qwen3", "half", sglang_rope="half", embedded=True, tool_formats=_QWEN3,
           reasoning=True),
    Family("mistral", "half", sglang_rope="half"),
    Family("qwen2_moe", "half", sglang_rope="half"),
    Family("qwen3_moe", "half", sglang_rope="half", tool_formats=_QWEN3, reasoning=True),
    Family("glm", "interleaved", rope_partial=True),
    Family("glm4", "interleaved", rope_partial=True),
    Family("phi3", "half", rope_partial=True),
    Family("stablelm", "half", rope_partial=True),
    Family("gpt_neox", "half", rope_partial=True),
)  # fmt: skip
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


def tool_format(model_type: str | None, chat_template: str | None) -> ToolFormat:
    """The tool-call format of a checkpoint: the first of its family's ``tool_formats`` whose
    ``marker`` its chat template holds, else Hermes (what ``leyline make-model``'s
    tokenizer writes for every family)."""
    row = family(model_type)
    for name in row.tool_formats if row is not None else ():
        if chat_template and TOOL_FORMATS[name].marker in chat_template:
            return TOOL_FORMATS[name]
    return TOOL_FORMATS["hermes"]


def reasons(model_type: str | None) -> bool:
    """Whether ``model_type``'s answers open with thinking (``reasoning_content``)."""
    row = family(model_type)
    return row is not None and row.reasoning


def embedded_model_types() -> tuple[str, ...]:
    return tuple(f.model_type for f in _ROWS if f.embedded)


def token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` in ``tokenizer``'s vocabulary, or None where it has none."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(tid, int) or isinstance(tid, bool):
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    return None if unk is not None and tid == unk else tid
