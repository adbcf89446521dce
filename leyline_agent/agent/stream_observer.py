"""Pass a streamed chat completion through and hand the assembled reply to a callback.

``ObservedStream`` / ``AsyncObservedStream`` wrap an OpenAI ``Stream`` / ``AsyncStream``:
iteration yields the same chunks; when the stream ends the deltas of choice 0 (content and
tool calls, by tool-call index) are assembled into an assistant message and passed to
``on_reply`` once. A Responses stream's last event (``response.completed`` or
``response.incomplete``) gives the reply from its output items instead. Everything else (``response``, ``close``, context manager) delegates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from leyline_agent.logs import get_logger
from leyline_agent.responses_items import reply_message

__all__ = ["AsyncObservedStream", "ObservedStream", "ReplyAssembler"]

log = get_logger(__name__)  # silent until configured (leyline_agent.logs)


def _field(obj: Any, name: str) -> Any:
    """``obj.name`` of an SDK chunk object, or ``obj[name]`` of a parsed JSON chunk."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _dumped(obj: Any) -> Any:
    """An SDK object as the plain JSON the server sent."""
    return obj.model_dump(exclude_none=True) if hasattr(obj, "model_dump") else obj


class ReplyAssembler:
    """Deltas of choice 0 assembled into an assistant message; chunks may be SDK objects
    (``ChatCompletionChunk``) or the parsed JSON of server-sent events (dicts)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.final: dict[str, Any] | None = None  # a Responses stream's reply

    def add(self, chunk: Any) -> None:
        if _field(chunk, "type") in ("response.completed", "response.incomplete"):
            output = _field(_field(chunk, "response"), "output") or []
            self.final = reply_message([_dumped(o) for o in output])
            return
        for choice in _field(chunk, "choices") or ():
            delta = _field(choice, "delta")
            if (_field(choice, "index") or 0) != 0 or delta is None:
                continue
            if _field(delta, "content"):
                self.content.append(_field(delta, "content"))
            for tc in _field(delta, "tool_calls") or ():
                call = self.calls.setdefault(
                    _field(tc, "index") or 0,
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if _field(tc, "id"):
                    call["id"] = _field(tc, "id")
                fn = _field(tc, "function")
                if fn is not None:
                    call["function"]["name"] += _field(fn, "name") or ""
                    call["function"]["arguments"] += _field(fn, "arguments") or ""

    def message(self) -> dict[str, Any]:
        if self.final is not None:
            return self.final
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.calls:
            msg["tool_calls"] = [self.calls[k] for k in sorted(self.calls)]
        return msg


class _Observed:
    def __init__(self, stream: Any, on_reply: Callable[[dict[str, Any]], None]) -> None:
        self._stream = stream
        self._on_reply = on_reply
        self._assembler = ReplyAssembler()
        self._done = False

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._on_reply(self._assembler.message())
            except Exception as e:  # noqa: BLE001 - observing must not break the stream
                log.warning("stream_observer.failed", error=f"{type(e).__name__}: {e}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class ObservedStream(_Observed):
    def __iter__(self) -> ObservedStream:
        return self

    def __next__(self) -> Any:
        try:
            chunk = next(self._stream)
        except StopIteration:
            self._finish()
            raise
        self._assembler.add(chunk)
        return chunk

    def __enter__(self) -> ObservedStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stream.__exit__(*exc)


class AsyncObservedStream(_Observed):
    def __aiter__(self) -> AsyncObservedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            chunk = await self._stream.__anext__()
        except StopAsyncIteration:
            self._finish()
            raise
        self._assembler.add(chunk)
        return chunk

    async def __aenter__(self) -> AsyncObservedStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stream.__aexit__(*exc)
