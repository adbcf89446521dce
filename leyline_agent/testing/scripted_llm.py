"""A scripted OpenAI-compatible endpoint on a free loopback port (test fixture only).

It answers ``/v1/chat/completions`` with canned assistant turns over real HTTP, so that an
agent loop (debug-gym's froggy, a wrapped client) runs end to end without a model. A turn is
``{"content": str | None, "tool": name, "arguments": {...}}``; the turn played is chosen by
the number of assistant messages already in the request (so every conversation replays the
script from its start, and several episodes can share one server); past the end of the
script the last turn repeats. It also serves ``/v1/models`` and the Leyline routes
(``/leyline/v1/stats`` counts requests and prompt characters / 4 as tokens; the directives
route answers ``fallback=True``: nothing is cached here). Every chat request body is kept in
``requests`` and its headers (names lower-cased) in ``request_headers``; directive requests
likewise in ``directive_requests`` / ``directive_headers``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from leyline_agent.wire import DirectivesResponse, StatsResponse

__all__ = ["ScriptedLLMServer", "Turn"]

Turn = dict[str, Any]


@dataclass
class ScriptedLLMServer:
    turns: list[Turn]
    model: str = "scripted"
    requests: list[dict[str, Any]] = field(default_factory=list)
    request_headers: list[dict[str, str]] = field(default_factory=list)
    directive_requests: list[dict[str, Any]] = field(default_factory=list)
    directive_headers: list[dict[str, str]] = field(default_factory=list)
    _httpd: ThreadingHTTPServer | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _prompt_tokens: int = 0

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self) -> ScriptedLLMServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(
                        200, {"object": "list", "data": [{"id": server.model, "object": "model"}]}
                    )
                elif self.path == "/leyline/v1/stats":
                    self._send(200, server.stats().model_dump())
                else:
                    self._send(404, {"error": {"type": "NotFound", "message": self.path}})

            def do_POST(self) -> None:
                body = json.loads(
                    self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}"
                )
                headers = {k.lower(): v for k, v in self.headers.items()}
                if self.path == "/v1/chat/completions":
                    self._send(200, server._complete(body, headers))
                elif self.path == "/leyline/v1/directives":
                    with server._lock:
                        server.directive_requests.append(body)
                        server.directive_headers.append(headers)
                    self._send(
                        200, DirectivesResponse(tokens=[], applied=[], fallback=True).model_dump()
                    )
                else:
                    self._send(404, {"error": {"type": "NotFound", "message": self.path}})

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> ScriptedLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> StatsResponse:
        with self._lock:
            return StatsResponse(requests=len(self.requests), prompt_tokens=self._prompt_tokens)

    def _complete(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        with self._lock:
            i = len(self.requests)
            self.requests.append(body)
            self.request_headers.append(headers)
            prompt = len(json.dumps(body.get("messages", []))) // 4
            self._prompt_tokens += prompt
        step = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        turn = self.turns[min(step, len(self.turns) - 1)]
        message: dict[str, Any] = {"role": "assistant", "content": turn.get("content")}
        if turn.get("tool"):
            message["tool_calls"] = [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {
                        "name": turn["tool"],
                        "arguments": json.dumps(turn.get("arguments", {})),
                    },
                }
            ]
        return {
            "id": f"chatcmpl-{i}",
            "object": "chat.completion",
            "created": 0,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if turn.get("tool") else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": 1,
                "total_tokens": prompt + 1,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
