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
held back, and so is whitespace that may turn out to precede a call); what the deltas add
up to equals the finished parse's fields. Pure: no engine, no HTTP.
"""

from __future__ import annotations

import functools
import json
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
        self._finishing = False
        self.fed, self.primed = "", 0  # everything pushed so far; how much was primed
        self._pending: list[tuple[str, str]] = self._events(self._parser.initial_events)

    def prime(self, opening: str) -> None:
        """Feed what the answer was forced to open with (not the engine's text)."""
        self.push(opening)
        self.primed = len(self.fed)

    def catch_up(self, answer: str) -> list[tuple[str, str]]:
        """Feed what the engine's whole ``answer`` holds past what was pushed (the engine's
        text is the source of truth)."""
        pushed = self.fed[self.primed :]
        return self.push(answer[len(pushed) :]) if answer.startswith(pushed) else []

    def push(self, delta: str) -> list[tuple[str, str]]:
        """(field, text) deltas of ``content`` / ``reasoning_content`` now certain."""
        self.fed += delta
        out, self._pending = self._pending + self._events(self._parser.feed(delta)), []
        return out

    def finish(self) -> tuple[list[tuple[str, str]], ParsedOutput]:
        """The last deltas, and the whole parse."""
        self._finishing = True
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

    def _events(self, events: list[dict[str, Any]]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
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
                    self._body = ""
                elif kind == "region_chunk":
                    self._body += e["text"]
                elif kind == "region_close":
                    out += self._close_call(e["value"])
        return out

    def _close_call(self, value: Any) -> list[tuple[str, str]]:
        assert self.fmt is not None  # a tool_calls region exists only with a format
        # at the end, a block the text ends inside was left open (its close never came)
        closed = not self._finishing or self.fmt.ends_at_eos or not self.fed.endswith(self._body)
        calls = _calls(value) if closed else None
        if calls is not None:
            self.calls += calls
            return []
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
