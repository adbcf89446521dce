"""Resource limits that are checked before the engine does any work.

- ``BodyLimit``: pure ASGI middleware. A request whose ``Content-Length`` is over the limit
  is answered 413 at once, without reading a byte of the body; a body without a length
  (chunked) is counted as it arrives and refused as soon as the count passes the limit.
- ``longest_token_bytes`` (``directives.validate``, shared with the vLLM plugin): computed
  once at start-up. Each token of a byte-level tokenizer without a normalizer covers at
  most that many bytes of the text, so ``utf8_bytes // longest`` is a lower bound on a
  text's token count: an obviously too-long prompt is refused before the tokenizer runs
  (``check_text_bound``). Tokenizers that normalize or drop characters (their bound would
  not hold) get no early check; the exact count after tokenizing is checked for every
  tokenizer.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline_agent.directives.validate import (
    check_text_bound,
    longest_token_bytes,
    message_text_bytes,
)
from leyline_agent.http import guards
from leyline_agent.server.errors import TrackedSend

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "BodyLimit",
    "BodyTooLargeError",
    "check_text_bound",
    "longest_token_bytes",
    "message_text_bytes",
]

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


class BodyTooLargeError(StarletteHTTPException):
    """Raised from ``receive`` once a streamed body passes the limit (FastAPI re-raises
    HTTP exceptions from body reading, so it is answered like any HTTP error)."""

    error_type = "PayloadTooLargeError"
    field = "body"

    def __init__(self, limit: int) -> None:
        super().__init__(413, guards.PayloadTooLargeError(limit).args[0])


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413 (see the module docstring)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_body_bytes: {max_bytes} must be >= 1")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if guards.content_length_over(scope.get("headers", ()), self.max_bytes):
            await guards.send_error(send, guards.PayloadTooLargeError(self.max_bytes))
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        tracked = TrackedSend(send)
        try:
            await self.app(scope, counted, tracked)
        except BodyTooLargeError:
            if tracked.started:
                raise
            await guards.send_error(send, guards.PayloadTooLargeError(self.max_bytes))
