"""Server-sent events and incremental detokenization for streamed completions.

``IncrementalText`` turns a growing list of token ids into text deltas that never need to
be taken back: it holds back an incomplete UTF-8 character, any tail that may still grow
into a stop string (or into ``<tool_call>`` when tools are on), and everything from a
complete stop string or tool-call tag on. When generation ends, ``finish`` sends what is
left of the engine's final text (which is the source of truth), so the concatenated deltas
equal the non-streamed answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DONE", "IncrementalText", "sse"]

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One SSE event exactly as OpenAI frames it: ``data: {json}`` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _partial_suffix(text: str, needles: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``needles``."""
    best = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:k]):
                best = k
                break
    return best


class IncrementalText:
    """Safe text deltas of a growing token sequence (see the module docstring)."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop: Sequence[str] = (),
        tool_tag: str | None = None,
    ) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._tool_tag = tool_tag
        self._ids: list[int] = []
        self._sent = ""
        self._frozen = False  # a stop string or a tool call started: send nothing more

    @property
    def sent(self) -> str:
        return self._sent

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._frozen:
            return ""
        text = self._decode(self._ids)
        end = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character
        for needle in [*self._stop, *([self._tool_tag] if self._tool_tag else [])]:
            at = text.find(needle)
            if 0 <= at < end:
                end, self._frozen = at, True
        if not self._frozen:
            needles = [*self._stop, *([self._tool_tag] if self._tool_tag else [])]
            end -= _partial_suffix(text[:end], needles)
        if self._tool_tag:  # content before a call loses trailing whitespace: hold it back
            end = len(text[:end].rstrip())
        return self._advance(text[:end])

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (or content) after what was sent."""
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self._sent) or not text.startswith(self._sent):
            return ""
        delta = text[len(self._sent) :]
        self._sent = text
        return delta
