"""Server-sent events, and the text deltas of a streamed answer.

The engine's ``on_token(token_id, text_delta)`` already gives text that never needs to be
taken back (``engine.detokenizer``: decoded incrementally, an incomplete UTF-8 character
held back, cut at a stop string). ``StreamedText`` adds what only the chat route knows:
with tools on, everything from a ``<tool_call>`` tag on is held back (the call is sent as
``tool_calls`` at the end), and so are a tail that may still grow into the tag and the
whitespace before it (content before a call loses it). When generation ends, ``finish``
sends what is left of the final content (the engine's text is the source of truth), so the
concatenated deltas equal the non-streamed answer.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DONE", "StreamedText", "sse"]

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One SSE event exactly as OpenAI frames it: ``data: {json}`` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _partial_suffix(text: str, needle: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``needle``."""
    for k in range(min(len(needle) - 1, len(text)), 0, -1):
        if text.endswith(needle[:k]):
            return k
    return 0


class StreamedText:
    """Safe deltas of a streamed answer from the engine's text deltas (see the module doc).

    ``prefix`` is text the answer opens with that the engine did not write (the tool-call
    opening a ``tool_choice`` forced into the prompt)."""

    def __init__(self, prefix: str = "", tool_tag: str | None = None) -> None:
        self._tool_tag = tool_tag
        self._pending = prefix  # written but not sent yet
        self._sent: list[str] = []
        self._frozen = False  # a tool call started: send nothing more

    @property
    def sent(self) -> str:
        return "".join(self._sent)

    def push(self, delta: str) -> str:
        if self._frozen:
            return ""
        text = self._pending + delta
        if self._tool_tag is None:
            out, self._pending = text, ""
        else:
            at = text.find(self._tool_tag)
            if at != -1:
                end, self._frozen = at, True
            else:
                end = len(text) - _partial_suffix(text, self._tool_tag)
            out = text[:end].rstrip()  # whitespace before a call is held back
            self._pending = text[len(out) :]
        if out:
            self._sent.append(out)
        return out

    def finish(self, final_text: str) -> str:
        """The rest of the final text (or content) after what was sent."""
        sent = self.sent
        if len(final_text) <= len(sent) or not final_text.startswith(sent):
            return ""
        rest = final_text[len(sent) :]
        self._sent.append(rest)
        return rest
