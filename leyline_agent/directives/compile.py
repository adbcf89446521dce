"""Compile message-level edits into token directives (torch-free: a tokenizer in, ids out).

Used by ``pipeline`` (which every backend runs), so all of them render, diff and compile
alike:

- ``render(tokenizer, messages, tools, add_generation_prompt)``: the token ids of a
  conversation under the tokenizer's chat template (messages checked and put in canonical
  form by ``checks.template_messages``, tools by ``chat_input.canonical_tools``).
- ``encode_replacements(directives, tokenizer)``: token form, text replacements -> ids;
  ``token_form(tokens, directives, tokenizer, vocab_size)`` adds the vocabulary checks.
- ``message_edits(tokenizer, old, new, tools, boundary)``: message form: both lists
  rendered (``add_generation_prompt=False``) and diffed per message (``diff_spans``).
- ``to_directives(spans, mode)``.

Seams: BPE may merge across the edge of an edited text (the token before or after an edit
can change too). Diffing token ids, not characters, absorbs that: every token that differs
is inside a span. The diff is taken per message: both sequences are cut at the message
boundary id (``families``: the special token that opens every message in the template),
chunks are paired in order, and each differing pair yields one span (common prefix and
suffix of the pair trimmed). That keeps one span per edited message even when the new text
shares tokens with the old (a stub that quotes the original's first line would otherwise
split into many small spans). When the two sequences do not have the same number of
messages the whole sequence is diffed as one chunk (still exact, possibly coarser).

``clip_to_cached`` restricts spans to a cached prefix of length ``c``: a span that ends by
``c`` is kept; a span that starts at or after ``c`` is dropped (nothing of it is cached; the
next request prefills it); a span that straddles ``c`` becomes ``(start, c, R)``: keep
``T[:start]``, prefill R now, no cached tail. ``T[:start] + R`` is a prefix of the new
sequence, so the next request hits it and prefills only what follows R.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from leyline_agent.chat_input import canonical_tools
from leyline_agent.directives import slow_lane
from leyline_agent.directives.checks import check_token_ids, template_messages
from leyline_agent.directives.core import Directive, Mode
from leyline_agent.directives.tool_prompt import prepare
from leyline_agent.errors import TrajectoryError

__all__ = [
    "MessageEdits",
    "Span",
    "apply_spans",
    "clip_to_cached",
    "diff_spans",
    "encode_replacements",
    "message_edits",
    "render",
    "to_directives",
    "token_form",
]


@dataclass(slots=True, frozen=True)
class Span:
    start: int
    end: int
    replacement: list[int]


def _chunks(ids: Sequence[int], boundary: int | None) -> list[tuple[int, int]]:
    if boundary is None:
        return [(0, len(ids))]
    cuts = [i for i, t in enumerate(ids) if t == boundary and i > 0]
    edges = [0, *cuts, len(ids)]
    return list(zip(edges, edges[1:], strict=False))


def _span(
    old: Sequence[int], new: Sequence[int], a: tuple[int, int], b: tuple[int, int]
) -> Span | None:
    (a0, a1), (b0, b1) = a, b
    p = 0
    while a0 + p < a1 and b0 + p < b1 and old[a0 + p] == new[b0 + p]:
        p += 1
    q = 0
    while a1 - q > a0 + p and b1 - q > b0 + p and old[a1 - q - 1] == new[b1 - q - 1]:
        q += 1
    if a0 + p == a1 - q and b0 + p == b1 - q:
        return None
    return Span(a0 + p, a1 - q, list(new[b0 + p : b1 - q]))


def diff_spans(old: Sequence[int], new: Sequence[int], boundary: int | None = None) -> list[Span]:
    """Non-overlapping spans of ``old`` (left to right) whose replacement turns it into ``new``."""
    ca, cb = _chunks(old, boundary), _chunks(new, boundary)
    if len(ca) != len(cb):
        ca, cb = [(0, len(old))], [(0, len(new))]
    spans = [s for a, b in zip(ca, cb, strict=True) if (s := _span(old, new, a, b)) is not None]
    merged: list[Span] = []
    for s in spans:  # touching spans (an insertion at a chunk edge) become one
        if merged and merged[-1].end == s.start:
            m = merged.pop()
            s = Span(m.start, s.end, m.replacement + s.replacement)
        merged.append(s)
    return merged


def clip_to_cached(spans: Sequence[Span], cached: int) -> list[Span]:
    out = []
    for s in spans:
        if s.end <= cached:
            out.append(s)
        elif s.start < cached:
            out.append(Span(s.start, cached, s.replacement))
    return out


def apply_spans(old: Sequence[int], spans: Sequence[Span]) -> list[int]:
    out = list(old)
    for s in sorted(spans, key=lambda s: s.start, reverse=True):
        out[s.start : s.end] = s.replacement
    return out


def render(
    tokenizer: Any,
    messages: Any,
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    *,
    where: str = "messages",
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` under ``tokenizer``'s chat template (``TrajectoryError``
    naming ``where`` if they cannot be rendered); tools and calls the template cannot render
    are written by ``tool_prompt.prepare``. ``template_kwargs``: more arguments of
    ``apply_chat_template`` (template variables, ``continue_final_message``)."""
    checked, tools_ = prepare(
        tokenizer, template_messages(messages, where), canonical_tools(tools), where
    )
    try:
        text = tokenizer.apply_chat_template(
            checked,
            tools=tools_,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    except Exception as e:  # template errors: jinja raises many types
        raise TrajectoryError(f"{where}: the chat template cannot render them: {e}") from e
    return slow_lane.tokenize(tokenizer, text)  # a large prompt: one at a time, low priority


def encode_replacements(directives: Sequence[Directive], tokenizer: Any) -> list[Directive]:
    """Token form: every text replacement encoded to ids (no special tokens added)."""
    out = []
    for d in directives:
        if isinstance(d.replacement, str):
            ids = list(tokenizer.encode(d.replacement, add_special_tokens=False))
            d = Directive(start=d.start, end=d.end, replacement=ids, mode=d.mode)
        out.append(d)
    return out


def token_form(
    tokens: Sequence[int], directives: Sequence[Directive], tokenizer: Any, vocab_size: int
) -> tuple[list[int], list[Directive]]:
    """A token-form request checked and compiled: ``tokens`` (not empty) and every
    replacement (text encoded) inside the vocabulary, or ``InvalidRequestError`` naming
    ``tokens[i]`` / ``directives[i].replacement[k]``."""
    ids = check_token_ids(tokens, vocab_size, "tokens")
    out = encode_replacements(directives, tokenizer)
    for i, d in enumerate(out):
        check_token_ids(d.replacement, vocab_size, f"directives[{i}].replacement", allow_empty=True)
    return ids, out


@dataclass(slots=True, frozen=True)
class MessageEdits:
    old: list[int]  # the rendered old messages: the base T
    new: list[int]  # the rendered new messages: what T' must be
    spans: list[Span]  # where they differ, left to right


def message_edits(
    tokenizer: Any,
    old_messages: Any,
    new_messages: Any,
    tools: Sequence[dict[str, Any]] | None,
    boundary: int | None,
) -> MessageEdits:
    """Message form: render both lists (no generation prompt) and diff them per message."""
    old = render(tokenizer, old_messages, tools, where="old_messages")
    new = render(tokenizer, new_messages, tools, where="new_messages")
    return MessageEdits(old, new, diff_spans(old, new, boundary))


def to_directives(
    spans: Sequence[Span], mode: Mode, budget: float | None = None
) -> list[Directive]:
    return [
        Directive(start=s.start, end=s.end, replacement=s.replacement, mode=mode, budget=budget)
        for s in spans
    ]
