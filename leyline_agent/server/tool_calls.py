"""A model's answer as OpenAI's message: ``content``, ``tool_calls``, ``reasoning_content``.

The parser is transformers' own streaming response parser
(``transformers.utils.chat_parsing.ResponseParser``, the one SGLang vendors too), run on a
response template per family format (``families.TOOL_FORMATS``: Hermes, Llama 3 JSON,
Qwen3 XML, DeepSeek V3; ``families.tool_format`` picks one from the checkpoint's chat
template). This module turns its regions into OpenAI's shapes:

- ``content``: the text outside every call (and outside the thinking); with calls, its
  trailing whitespace is dropped, and it is None when nothing is left;
- ``tool_calls``: each block whose body is a call (``name``, and ``arguments`` or
  ``parameters`` an object or a JSON string of one) with a fresh id and the arguments as a
  JSON string. A block that is not a call - bad JSON, no name, left open when generation
  stopped - goes back into the content (verbatim for Hermes), so nothing the model wrote
  is lost;
- ``reasoning_content``: for a reasoning family, the ``<think>...</think>`` span (also when
  the prompt opened it), stripped; ``split_reasoning`` is that alone, for any caller.

``ResponseStream`` is the same parse fed delta by delta: it gives content and reasoning
deltas as they become certain (a call's text and a tail that may grow into a delimiter are
held back, and so is whitespace that may turn out to precede a call), and tool-call deltas
in OpenAI's streaming shape (``{"index", "id", "type", "function": {"name", "arguments"}}``
once, then ``{"index", "function": {"arguments"}}`` pieces); what the deltas add up to
equals the finished parse's fields. A Hermes call streams its arguments as the model writes
them: once a block opens with ``{"name": F, "arguments": {`` it is a call, its arguments are
the model's text up to the object's close (held back: a trailing ``}`` and whitespace that
may be that close), and it stays a call however it ends. Other formats send each call whole
when its block closes. An answer cut by the token budget (``finish(truncated=True)``) keeps
a streamed call with the arguments written so far (as OpenAI does) and drops a block cut
before its head: a half call is never content. Pure: no engine, no HTTP.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transformers.utils.chat_parsing import ResponseParser

from leyline_agent.families import (
    ASSISTANT_OPENERS,
    CHATML_HERMES,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_FORMATS,
    ToolFormat,
    reasons,
    tool_format,
)

if TYPE_CHECKING:
    from leyline_agent.server.worker import ServedEngine

__all__ = [
    "CLOSE_TAG",
    "HERMES",
    "OPEN_TAG",
    "ParsedOutput",
    "ResponseStream",
    "new_call_id",
    "parse_response",
    "parse_tool_calls",
    "served_format",
    "split_reasoning",
]

OPEN_TAG = CHATML_HERMES.tool_call_open
CLOSE_TAG = CHATML_HERMES.tool_call_close
HERMES = TOOL_FORMATS["hermes"]
# A Hermes block's head, up to its arguments object (the forced-call grammar writes it so).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_TAIL = re.compile(r"\}?\s*\Z")  # what may still be the block's own close: held back


@dataclass(slots=True)
class ParsedOutput:
    """``content`` is None when the model only called tools (as OpenAI reports it)."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning_content: str | None = None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def served_format(engine: ServedEngine) -> tuple[ToolFormat, bool]:
    """(the tool-call format, whether it reasons) of the checkpoint ``engine`` serves."""
    model_type = getattr(getattr(engine, "config", None), "model_type", None)
    template = getattr(getattr(engine, "tokenizer", None), "chat_template", None)
    return tool_format(model_type, template if isinstance(template, str) else None), reasons(
        model_type
    )


@functools.lru_cache(maxsize=32)
def _template(fmt_name: str | None, reasoning: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {"content": {"content": "text", "content_args": {"strip": False}}}
    if reasoning:
        fields["reasoning_content"] = {
            "open": THINK_OPEN, "close": THINK_CLOSE, "content": "text",
            "content_args": {"strip": False},
        }  # fmt: skip
    if fmt_name is not None:
        fmt = TOOL_FORMATS[fmt_name]
        fields["tool_calls"] = fmt.tool_calls
        if fmt.ignored:  # opened and at once closed: in no field
            fields["ignored"] = {"open": list(fmt.ignored), "close_pattern": ""}
    return {"start_anchor": list(ASSISTANT_OPENERS), "fields": fields}


def _arguments(args: Any) -> str | None:
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    if isinstance(args, str):
        try:
            return args if isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    return None


def _call(obj: Any) -> dict[str, Any] | None:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = _arguments(obj.get("arguments", obj.get("parameters", {})))
    if arguments is None:
        return None
    fn = {"name": obj["name"], "arguments": arguments}
    return {"id": new_call_id(), "type": "function", "function": fn}


def _calls(value: Any) -> list[dict[str, Any]] | None:
    """The calls of one block's parsed value (None: it is not a call)."""
    if isinstance(value, str):  # text, or JSON that did not parse: ';'-separated objects
        try:
            value = [json.loads(part) for part in value.split(";") if part.strip()]
        except ValueError:
            return None
    calls = [_call(v) for v in (value if isinstance(value, list) else [value])]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


class _Held:
    """Deltas of one text field, trailing whitespace held back (``lead``: leading dropped)."""

    def __init__(self, lead: bool = False) -> None:
        self.parts: list[str] = []
        self.pending, self.lead = "", lead

    def push(self, text: str) -> str:
        text = self.pending + text
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        out = text.rstrip()
        self.pending = text[len(out) :]
        if out:
            self.parts.append(out)
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        if out:
            self.parts.append(out)
        return out

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass(slots=True)
class _OpenCall:
    """A Hermes call whose head was parsed: its arguments start at ``start`` of the body."""

    index: int
    id: str
    name: str
    start: int
    sent: int = 0  # characters of the arguments sent as deltas

    def delta(self, arguments: str) -> dict[str, Any]:
        return {"index": self.index, "function": {"arguments": arguments}}


_DECODER = json.JSONDecoder()


def _object_end(text: str) -> int | None:
    """Where the JSON object ``text`` opens with ends, once it is complete (else None)."""
    if "}" not in text:
        return None
    try:
        value, end = _DECODER.raw_decode(text)
    except ValueError:
        return None
    return end if isinstance(value, dict) else None


def _call_delta(index: int, call: dict[str, Any]) -> dict[str, Any]:
    """A call's first delta (OpenAI's streaming shape)."""
    return {"index": index, **call}


class ResponseStream:
    """The parse of an answer fed delta by delta (see the module doc).

    ``fmt``: the tool-call format (None: calls are not parsed, ``tool_choice`` none or no
    tools); ``reasoning``: split out ``<think>``; ``prefix``: what the prompt wrote of the
    answer (the generation prompt's tail, such as an opened ``<think>``); ``tools``: the
    request's tools (typed arguments of XML formats are cast by their schema)."""

    def __init__(
        self,
        fmt: ToolFormat | None = HERMES,
        *,
        reasoning: bool = False,
        prefix: str = "",
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.fmt = fmt
        self._parser = ResponseParser(
            _template(fmt.name if fmt else None, reasoning), prefix=_tail(prefix), tools=tools
        )
        self._content, self._thinking = _Held(), _Held(lead=True)
        self._body, self._saw_thinking = "", False
        self.calls: list[dict[str, Any]] = []
        self._open: _OpenCall | None = None  # the Hermes call being streamed
        self._finishing = self._truncated = False
        self.fed, self.primed = "", 0  # everything pushed so far; how much was primed
        self._pending: list[tuple[str, str]] = self._events(self._parser.initial_events)

    def prime(self, opening: str) -> None:
        """Feed what the answer was forced to open with (not the engine's text)."""
        self.push(opening)
        self.primed = len(self.fed)

    def catch_up(self, answer: str) -> list[tuple[str, Any]]:
        """Feed what the engine's whole ``answer`` holds past what was pushed (the engine's
        text is the source of truth)."""
        pushed = self.fed[self.primed :]
        return self.push(answer[len(pushed) :]) if answer.startswith(pushed) else []

    def push(self, delta: str) -> list[tuple[str, Any]]:
        """(field, delta) now certain: text of ``content`` / ``reasoning_content``, or a
        ``tool_calls`` delta (one call's, OpenAI's streaming shape)."""
        self.fed += delta
        out, self._pending = self._pending + self._events(self._parser.feed(delta)), []
        return out

    def finish(self, truncated: bool = False) -> tuple[list[tuple[str, Any]], ParsedOutput]:
        """The last deltas, and the whole parse; ``truncated``: the token budget cut the
        answer (a block it cut is a call if its head was written, else dropped)."""
        self._finishing, self._truncated = True, truncated
        _, events = self._parser.finalize()
        out = self._pending + self._events(events)
        self._pending = []
        if not self.calls:  # whitespace held back for a call that never came
            out += [("content", t) for t in [self._content.flush()] if t]
        thinking = self._thinking.text if self._saw_thinking else None
        content = self._content.text
        if self.calls:
            content = content.rstrip()
        parsed = ParsedOutput(
            content=content if content.strip() or not self.calls else None,
            tool_calls=self.calls,
            reasoning_content=thinking or None,
        )
        return out, parsed

    def _events(self, events: list[dict[str, Any]]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for e in events:
            name, kind = e["field"], e["type"]
            if name == "reasoning_content":
                self._saw_thinking = True
                if kind == "region_chunk" and (t := self._thinking.push(e["text"])):
                    out.append(("reasoning_content", t))
                elif kind == "region_close":
                    self._content.lead = True  # the answer's text starts after the thinking
            elif name == "content" and kind == "region_chunk":
                if t := self._content.push(e["text"]):
                    out.append(("content", t))
            elif name == "tool_calls":
                if kind == "region_open":
                    self._body, self._open = "", None
                elif kind == "region_chunk":
                    self._body += e["text"]
                    out += self._stream_call()
                elif kind == "region_close":
                    out += self._close_call(e["value"])
        return out

    def _stream_call(self) -> list[tuple[str, Any]]:
        """Deltas of the Hermes call being written: its head once, then its arguments."""
        if self.fmt is not HERMES:
            return []
        out: list[tuple[str, Any]] = []
        if self._open is None:
            head = _HEAD.match(self._body)
            if head is None:
                return []
            name = json.loads(head.group(1))
            if not name:
                return []
            self._open = _OpenCall(len(self.calls), new_call_id(), name, head.end())
            fn = {"name": name, "arguments": ""}
            out.append(("tool_calls", _call_delta(self._open.index, {
                "id": self._open.id, "type": "function", "function": fn})))  # fmt: skip
        args = self._body[self._open.start :]
        ready = _object_end(args) or len(args) - len(_TAIL.search(args).group())  # type: ignore[union-attr]
        if ready > self._open.sent:
            out.append(("tool_calls", self._open.delta(args[self._open.sent : ready])))
            self._open.sent = ready
        return out

    def _close_open_call(self, closed: bool) -> list[tuple[str, Any]]:
        """The streamed call's last arguments delta; it joins ``calls``."""
        call, args = self._open, self._body[self._open.start :]  # type: ignore[union-attr]
        assert call is not None
        end = _object_end(args)
        if end is not None:  # the arguments object is complete: what follows is not in it
            args = args[:end]
        elif closed or not self._truncated:  # a malformed end: all but the held-back close
            args = args[: len(args) - len(_TAIL.search(args).group())]  # type: ignore[union-attr]
        self._open = None
        fn = {"name": call.name, "arguments": args}
        self.calls.append({"id": call.id, "type": "function", "function": fn})
        rest = args[call.sent :]
        return [("tool_calls", call.delta(rest))] if rest else []

    def _close_call(self, value: Any) -> list[tuple[str, Any]]:
        assert self.fmt is not None  # a tool_calls region exists only with a format
        # at the end, a block the text ends inside was left open (its close never came)
        closed = not self._finishing or self.fmt.ends_at_eos or not self.fed.endswith(self._body)
        if self._open is not None:
            return self._close_open_call(closed)
        calls = _calls(value) if closed else None
        if calls is not None:
            first = len(self.calls)
            self.calls += calls
            return [("tool_calls", _call_delta(first + k, c)) for k, c in enumerate(calls)]
        if not closed and self._truncated:
            return []  # cut by the budget before it was a call: not content either
        raw = self.fmt.open + self._body + (self.fmt.close if closed else "")
        text = self._content.push(raw)  # not a call: it stays in the content
        return [("content", text)] if text else []


def _tail(prompt_tail: str) -> str:
    """What the prompt wrote of the answer: the text after its last assistant opener."""
    ends = [prompt_tail.rfind(o) + len(o) for o in ASSISTANT_OPENERS if o in prompt_tail]
    return prompt_tail[max(ends) :] if ends else ""


def parse_response(
    text: str,
    fmt: ToolFormat | None = HERMES,
    *,
    reasoning: bool = False,
    prefix: str = "",
    tools: list[dict[str, Any]] | None = None,
) -> ParsedOutput:
    """The whole answer ``text`` parsed at once (``ResponseStream``'s result)."""
    stream = ResponseStream(fmt, reasoning=reasoning, prefix=prefix, tools=tools)
    stream.push(text)
    return stream.finish()[1]


def parse_tool_calls(text: str) -> ParsedOutput:
    """Hermes calls of ``text``: without a well-formed call the content is ``text``
    unchanged; with calls, the text around them, trailing whitespace removed (or None)."""
    return parse_response(text, HERMES)


def split_reasoning(text: str, prefix: str = "") -> tuple[str | None, str]:
    """(the ``<think>`` span's text, stripped, or None; the answer after it). ``prefix``:
    the prompt's tail, if the generation prompt opened the thinking."""
    parsed = parse_response(text, None, reasoning=True, prefix=prefix)
    return parsed.reasoning_content, parsed.content or ""
