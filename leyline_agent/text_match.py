"""Text matching in time linear in the text, for patterns and templates a client may send.

Python's ``re`` backtracks: ``(a+)+$`` on 40 characters runs for hours, holding the GIL (the
server's event loop and step thread wait with it). So nothing that matches client-supplied
or client-sized text backtracks:

- ``compile_pattern``: a regular expression in RE2's syntax (``google-re2``: a DFA/NFA engine,
  time linear in the text; no backreferences or lookaround, which are refused with a
  ``ValueError`` naming the pattern, as is a pattern whose automaton would pass RE2's memory
  budget);
- ``fills_template``: whether a text is a template with its ``{hole}`` placeholders filled in
  (holes match anything; everything else is literal text), by scanning, never by building a
  regex out of the template;
- ``cut_spans``: the spans ``open ... close`` (shortest, left to right, with the whitespace
  after each) cut out of a text, one left-to-right scan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import re2

__all__ = ["MAX_PATTERN_CHARS", "compile_pattern", "cut_spans", "fills_template", "has_span"]

MAX_PATTERN_CHARS = 1000
_PATTERN_MEMORY = 8 << 20  # RE2's own default budget for one compiled pattern


def compile_pattern(pattern: str, *, multiline: bool = False) -> Any:
    """``pattern`` compiled by RE2 (``^``/``$`` per line with ``multiline``); ``ValueError``
    saying why it cannot be."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"is {len(pattern)} characters long (at most {MAX_PATTERN_CHARS})")
    options = re2.Options()
    options.log_errors = False
    options.max_mem = _PATTERN_MEMORY
    try:
        return re2.compile(f"(?m){pattern}" if multiline else pattern, options)
    except re2.error as e:
        why = e.args[0].decode() if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"is not a linear-time (RE2) regular expression: {why}") from e


def fills_template(text: str, template: str, holes: Sequence[str]) -> bool:
    """Whether ``text`` is ``template`` with each occurrence of a hole replaced by any text.

    The literal pieces between holes must appear in order, the first at the start and the
    last at the end; the middle ones are found leftmost-first, which is enough (a later
    occurrence leaves less room for the rest)."""
    pieces = [template]
    for hole in holes:
        pieces = [part for piece in pieces for part in piece.split(hole)]
    if len(pieces) == 1:
        return text == template
    head, *middle, tail = pieces
    if len(text) < len(head) + len(tail) or not text.startswith(head) or not text.endswith(tail):
        return False
    pos, end = len(head), len(text) - len(tail)
    for piece in middle:
        found = text.find(piece, pos, end)
        if found < 0:
            return False
        pos = found + len(piece)
    return True


def has_span(text: str, open_tag: str, close_tag: str) -> bool:
    """Whether ``text`` holds ``open_tag`` followed (later) by ``close_tag``."""
    start = text.find(open_tag)
    return start >= 0 and text.find(close_tag, start + len(open_tag)) >= 0


def cut_spans(text: str, open_tag: str, close_tag: str) -> str:
    """``text`` without its ``open_tag ... close_tag`` spans and the whitespace after each.

    Each span runs from an ``open_tag`` to the first ``close_tag`` after it; an ``open_tag``
    with no ``close_tag`` after it ends the scan (no later one has one either)."""
    out: list[str] = []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            break
        close = text.find(close_tag, start + len(open_tag))
        if close < 0:
            break
        out.append(text[pos:start])
        pos = close + len(close_tag)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    out.append(text[pos:])
    return "".join(out)
