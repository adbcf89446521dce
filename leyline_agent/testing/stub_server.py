"""The OpenAI-compatible stub server on loopback, for tests of the agent side.

    with StubServer(ScriptedModel([...])) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="stub")  # .../v1
        ...
        server.chat_bodies()        # every /v1/chat/completions body, as received
        server.directive_bodies()   # every /leyline/v1/directives body, as received
        server.chat_headers()       # their headers (names lower-cased), same order

A real HTTP server (stdlib ``ThreadingHTTPServer`` in a daemon thread) on 127.0.0.1 and a
random port; ``url`` is its root, ``base_url`` the OpenAI base URL (``url + "/v1"``), as
``testing.server.ThreadServer`` has them. ``script`` is any ``messages -> assistant
message`` callable (``testing.scripted``: ``ScriptedModel`` plays turns in order,
``ReplayModel`` replays a debug-gym-style script per conversation). Routes:
- ``POST /v1/chat/completions``: the script's reply, as JSON or (``stream``) as server-sent
  events (content in small pieces, tool-call arguments in pieces). ``usage`` counts the
  prompt's JSON characters / 4 as its tokens, none of them cached.
- ``GET /v1/models``: ``model`` (the served name).
- ``POST /leyline/v1/directives``: validated as a ``DirectivesRequest`` (400 with an
  ``ErrorBody`` if not), recorded, answered with a ``DirectivesResponse`` (no tokens: the
  stub has no tokenizer): ``directive_answer="splices"`` counts the messages that differ
  in ``splices[mode]``; ``"fallback"`` answers ``fallback=True`` (nothing cached here).
- ``GET /leyline/v1/stats``: a ``StatsResponse`` of what the stub saw (chat requests, their
  prompt tokens, the splices it answered).
``leyline_routes=False`` makes it a plain OpenAI-compatible endpoint (404 on /leyline/...);
``directives_status=500`` makes the directives route fail (to test fallbacks);
``directives_delay_s`` makes it answer late (to test client timeouts);
``directive_faults`` makes the first directive requests fail *after* they were received
and recorded, one fault each, in order: ``"reset"`` (the connection is reset, no answer),
``"close"`` (closed without an answer) or a status such as ``"503"`` (with ``Retry-After:
retry_after`` unless that is None); the requests after them are answered normally.
``api_key``: every route but ``/health`` wants ``Authorization: Bearer <api_key>`` and
answers 401 without it (the request is still recorded).
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import ValidationError

from leyline_agent.http_errors import error_body
from leyline_agent.wire import (
    BODY_EDITS,
    CLIENT_EDITS,
    DirectivesRequest,
    DirectivesResponse,
    ErrorBody,
    StatsResponse,
)

__all__ = ["RecordedRequest", "StubServer", "prompt_tokens"]


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    method: str
    path: str
    body: Any  # parsed JSON, or None
    headers: dict[str, str] = field(default_factory=dict)  # names lower-cased


class StubServer:
    def __init__(
        self,
        script: Callable[[list[dict[str, Any]]], dict[str, Any]],
        *,
        model: str = "scripted",
        directive_answer: str = "splices",
        leyline_routes: bool = True,
        directives_status: int = 200,
        directives_delay_s: float = 0.0,
        directive_faults: Sequence[str] = (),
        retry_after: str | None = "0",
        api_key: str | None = None,
        chunk_chars: int = 7,
    ) -> None:
        if directive_answer not in ("splices", "fallback"):
            raise ValueError(f"directive_answer: {directive_answer!r} is not splices or fallback")
        self.script = script
        self.model = model
        self.directive_answer = directive_answer
        self.leyline_routes = leyline_routes
        self.directives_status = directives_status
        self.directives_delay_s = directives_delay_s
        self.directive_faults = list(directive_faults)
        self.retry_after = retry_after
        self.api_key = api_key
        self.chunk_chars = chunk_chars
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> StubServer:
        handler = type("Handler", (_Handler,), {"stub": self})
        self._httpd = _QuietServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("StubServer is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        """What the OpenAI client takes: ``http://host:port/v1``."""
        return f"{self.url}/v1"

    # -- what was received ------------------------------------------------------------------
    def record(
        self, method: str, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> None:
        with self._lock:
            self.requests.append(RecordedRequest(method, path, body, dict(headers or {})))

    def bodies(self, path: str) -> list[Any]:
        with self._lock:
            return [r.body for r in self.requests if r.path == path]

    def headers(self, path: str) -> list[dict[str, str]]:
        with self._lock:
            return [r.headers for r in self.requests if r.path == path]

    def chat_bodies(self) -> list[dict[str, Any]]:
        return self.bodies("/v1/chat/completions")

    def directive_bodies(self) -> list[dict[str, Any]]:
        return self.bodies("/leyline/v1/directives")

    def chat_headers(self) -> list[dict[str, str]]:
        return self.headers("/v1/chat/completions")

    def directive_headers(self) -> list[dict[str, str]]:
        return self.headers("/leyline/v1/directives")

    def take_directive_fault(self) -> str | None:
        with self._lock:
            return self.directive_faults.pop(0) if self.directive_faults else None

    def stats(self) -> StatsResponse:
        splices: dict[str, int] = {"amortize": 0, "forget": 0}
        if self.directive_answer == "splices":
            for body in self.directive_bodies():
                mode = body.get("mode", "amortize")
                splices[mode] = splices.get(mode, 0) + 1
        chats = self.chat_bodies()
        prompt = sum(prompt_tokens(b) for b in chats)
        return StatsResponse(  # it says, as leyline serve does, that chat bodies carry edits
            requests=len(chats), prompt_tokens=prompt, splices=splices, features=(BODY_EDITS, CLIENT_EDITS)
        )


def prompt_tokens(body: Any) -> int:
    """The stub's token count of a chat request: its messages' JSON characters / 4."""
    messages = body.get("messages", []) if isinstance(body, dict) else []
    return len(json.dumps(messages)) // 4


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)  # a client that left is not an error


def _chunks(text: str, n: int) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)] or [""]


class _Handler(BaseHTTPRequestHandler):
    stub: StubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, type_: str, message: str, field: str | None = None) -> None:
        self._send_json(
            status, {"error": error_body(type_, message, field, status=status).model_dump()}
        )

    def _read_json(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else None

    def _headers(self) -> dict[str, str]:
        return {k.lower(): v for k, v in self.headers.items()}

    def _refused(self, path: str) -> bool:
        """Answer 401 if the stub wants a key and the request does not carry it."""
        key = self.stub.api_key
        if key is None or path == "/health":
            return False
        if self.headers.get("Authorization") == f"Bearer {key}":
            return False
        self._error(401, "AuthenticationError", "missing or wrong API key")
        return True

    def _fail(self, fault: str) -> None:
        """Fail a request that was received: no answer, or an error status."""
        if fault in ("reset", "close"):
            if fault == "reset":  # RST instead of FIN: the client reads ECONNRESET
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            self.close_connection = True
            self.connection.close()
            return
        status = int(fault)
        data = json.dumps(
            {"error": ErrorBody(type="StubFailure", message=f"fault {fault}").model_dump()}
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.stub.retry_after is not None:
            self.send_header("Retry-After", self.stub.retry_after)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?")[0]
        self.stub.record("GET", path, None, self._headers())
        if self._refused(path):
            return
        if path == "/v1/models":
            self._send_json(
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": self.stub.model, "object": "model", "created": 0, "owned_by": "stub"}
                    ],
                },
            )
        elif path == "/leyline/v1/stats" and self.stub.leyline_routes:
            self._send_json(200, self.stub.stats().model_dump())
        else:
            self._error(404, "NotFound", f"no route {path}")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?")[0]
        try:
            body = self._read_json()
        except json.JSONDecodeError as e:
            self.stub.record("POST", path, None, self._headers())
            return self._error(400, "BadRequest", f"body is not JSON: {e}")
        self.stub.record("POST", path, body, self._headers())
        if self._refused(path):
            return None
        if path == "/v1/chat/completions":
            return self._chat(body)
        if path == "/leyline/v1/directives" and self.stub.leyline_routes:
            fault = self.stub.take_directive_fault()
            return self._fail(fault) if fault is not None else self._directives(body)
        self._error(404, "NotFound", f"no route {path}")

    def _directives(self, body: Any) -> None:
        if self.stub.directives_delay_s:
            time.sleep(self.stub.directives_delay_s)
        if self.stub.directives_status != 200:
            return self._error(
                self.stub.directives_status, "StubFailure", "directives disabled by the test"
            )
        try:
            req = DirectivesRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err.get("loc", ())) or None
            return self._error(400, "DirectiveError", err.get("msg", str(e)), field)
        if self.stub.directive_answer == "fallback":
            resp = DirectivesResponse(outcome="fallback", tokens=[], applied=[], fallback=True)
            return self._send_json(200, resp.model_dump(mode="json"))
        changed = 0
        if req.old_messages is not None and req.new_messages is not None:
            changed = sum(
                1 for a, b in zip(req.old_messages, req.new_messages, strict=False) if a != b
            )
        resp = DirectivesResponse(tokens=[], applied=[], splices={req.mode.value: changed})
        self._send_json(200, resp.model_dump(mode="json"))

    def _chat(self, body: dict[str, Any]) -> None:
        try:
            reply = self.stub.script(list(body.get("messages") or []))
        except Exception as e:  # noqa: BLE001 - report to the client
            return self._error(500, type(e).__name__, str(e))
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        n = len(self.stub.chat_bodies())
        base = {"id": f"chatcmpl-stub-{n}", "created": 0, "model": body.get("model", self.stub.model)}
        if not body.get("stream"):
            p = prompt_tokens(body)
            usage = {
                "prompt_tokens": p,
                "completion_tokens": 1,
                "total_tokens": p + 1,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            choice = {"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}
            return self._send_json(
                200, {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            )
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def emit(delta: dict[str, Any], finish_reason: str | None = None) -> None:
            chunk = {
                **base,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            }
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())

        emit({"role": "assistant", "content": ""})
        for piece in _chunks(reply.get("content") or "", self.stub.chunk_chars):
            if piece:
                emit({"content": piece})
        for k, call in enumerate(reply.get("tool_calls") or ()):
            fn = call["function"]
            emit(
                {
                    "tool_calls": [
                        {
                            "index": k,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": fn["name"], "arguments": ""},
                        }
                    ]
                }
            )
            for piece in _chunks(fn["arguments"], self.stub.chunk_chars):
                emit({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
        emit({}, finish)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
