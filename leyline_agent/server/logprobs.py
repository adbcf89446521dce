"""The engine's per-token log-probabilities in OpenAI's two formats.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``.
Legacy completions: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leyline_agent.engine.params import TokenLogprob

__all__ = ["chat", "legacy"]


def _get(entry: object, *names: str, default: object = None) -> Any:
    for name in names:
        if isinstance(entry, Mapping):
            if name in entry:
                return entry[name]
        elif hasattr(entry, name):
            return getattr(entry, name)
    return default


FLOOR = -9999.0  # stands for -inf, which JSON cannot carry


def _finite(value: float) -> float:
    v = float(value)
    return v if math.isfinite(v) else FLOOR


def _token(entry: object) -> tuple[str, float]:
    return str(_get(entry, "text", "token", default="")), _finite(_get(entry, "logprob"))


def _top(entry: object) -> list[tuple[str, float]]:
    """The engine's alternatives: ``(token_id, text, logprob)`` tuples (or entries)."""
    top = _get(entry, "top", "top_logprobs", default=None) or []
    return [(str(t[1]), _finite(t[2])) if isinstance(t, tuple | list) else _token(t) for t in top]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat(entries: Iterable[TokenLogprob] | None) -> dict[str, Any]:
    content = []
    for e in entries or []:
        text, logprob = _token(e)
        content.append(
            {
                "token": text,
                "logprob": logprob,
                "bytes": _bytes(text),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": _bytes(t)} for t, v in _top(e)
                ],
            }
        )
    return {"content": content, "refusal": None}


def legacy(entries: Iterable[TokenLogprob] | None, top_k: int) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for e in entries or []:
        text, logprob = _token(e)
        tokens.append(text)
        token_logprobs.append(logprob)
        offsets.append(offset)
        offset += len(text)
        if top_k:
            top: dict[str, float] = {}
            for t, v in _top(e):
                top.setdefault(t, v)
            tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops if top_k else None,
        "text_offset": offsets,
    }
