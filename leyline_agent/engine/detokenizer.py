"""Incremental detokenization with stop strings: one per generation, one decode per token.

Decoding the whole output at every token costs O(n) per token (O(n^2) per answer). As vLLM
and SGLang do, ``Detokenizer`` decodes only a window: ``ids[prefix_offset:]`` against
``ids[prefix_offset:read_offset]``, where ``read_offset`` is where the text was last
complete and ``prefix_offset`` where the window before it started; what the new tokens add
is the difference. A window whose text ends in U+FFFD (an incomplete UTF-8 character,
spread over several byte tokens) waits for the next token. Windows start at character
boundaries, so the concatenated text equals ``decode(ids)``.

Stop strings: ``push`` returns the new text that is safe to emit: nothing from a complete
stop string on (``stopped`` is then set and ``text`` ends before it), and nothing that could
still be the start of one. ``flush`` (when generation ends) returns the rest: the held-back
tail, and an incomplete character as U+FFFD. So the deltas add up to ``text``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Detokenizer"]


class Detokenizer:
    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self._keep = max((len(s) for s in self.stops), default=1) - 1  # stop tail to keep
        self.ids: list[int] = []
        self.stopped = False
        self._prefix_offset = 0
        self._read_offset = 0
        self._chunks: list[str] = []  # the decoded text of ids[:read_offset], in pieces
        self._length = 0
        self._region = ""  # the last piece, after the tail of the text before it
        self._base = 0  # where _region starts in the text
        self._cut: int | None = None  # where a stop string starts in the text
        self._emitted = 0

    @property
    def text(self) -> str:
        """The answer so far: the decoded text, cut before a stop string."""
        full = "".join(self._chunks)
        return full if self._cut is None else full[: self._cut]

    def push(self, token_id: int) -> str:
        """Add one token; the text now safe to emit (see the module docstring)."""
        self.ids.append(token_id)
        if self.stopped:
            return ""
        self._advance(final=False)
        return self._emit(self._safe())

    def flush(self) -> str:
        """Generation ended: everything not emitted yet (a stop string's text excepted)."""
        if not self.stopped:
            self._advance(final=True)
        return self._emit(self._cut if self._cut is not None else self._length)

    def _advance(self, final: bool) -> None:
        if self._read_offset == len(self.ids):
            return
        before = self._decode(self._prefix_offset, self._read_offset)
        after = self._decode(self._prefix_offset, len(self.ids))
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return  # no complete character yet
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        new = after[len(before) :]
        tail = self._region[-self._keep :] if self._keep else ""
        self._region, self._base = tail + new, self._length - len(tail)
        self._chunks.append(new)
        self._length += len(new)
        hits = [k for s in self.stops if (k := self._region.find(s)) != -1]
        if hits:
            self.stopped = True
            self._cut = self._base + min(hits)

    def _safe(self) -> int:
        """How far the text can be emitted: to a stop string, or else all but a tail that
        may still grow into one."""
        if self._cut is not None:
            return self._cut
        region, safe = self._region, self._length
        for s in self.stops:
            for n in range(min(len(s) - 1, len(region)), 0, -1):
                if region.endswith(s[:n]):
                    safe = min(safe, self._length - n)
                    break
        return safe

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self._region[self._emitted - self._base : upto - self._base]
        self._emitted = upto
        return delta

    def _decode(self, lo: int, hi: int) -> str:
        if lo >= hi:
            return ""
        return self.tokenizer.decode(self.ids[lo:hi], skip_special_tokens=True)
