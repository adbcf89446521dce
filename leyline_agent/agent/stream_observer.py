"""Pass a streamed chat completion through and hand the assembled reply to a callback.

``ObservedStream`` / ``AsyncObservedStream`` wrap an OpenAI ``Stream`` / ``AsyncStream``:
iteration yields the same chunks; when the stream ends the deltas of choice 0 (content and
tool calls, by tool-call index) are assembled into an assistant message and passed to
``on_reply`` once. Everything else (``response``, ``close``, context manager) delegates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from leyline_agent.logs import get_logger

__all__ = ["AsyncObservedStream", "ObservedStream", "ReplyAssembler"]

log = get_logger(__name__)  # silent until configured (leyline_agent.logs)


class ReplyAssembler:
    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, chunk: Any) -> None:
        for choice in getattr(chunk, "choices", None) or ():
            if getattr(choice, "index", 0) != 0 or choice.delta is None:
                continue
            delta = choice.delta
            if delta.content:
                self.content.append(delta.content)
            for tc in delta.tool_calls or ():
                call = self.calls.setdefault(
                    tc.index,
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if tc.id:
                    call["id"] = tc.id
                if tc.function is not None:
                    call["function"]["name"] += tc.function.name or ""
                    call["function"]["arguments"] += tc.function.arguments or ""

    def message(self) -> dict[str, Any]:
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
