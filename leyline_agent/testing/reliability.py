"""Watch a live server while a hostile request runs: its ``/health`` and a bystander's stream.

A request that holds the event loop, the GIL or the engine shows up in two places a client
can see: ``/health`` answers late, and another tenant's streamed answer stops between two
tokens. ``Watch`` measures both from outside the server (its own threads, over HTTP):

- ``HealthProbe``: polls ``GET /health`` back to back (a short pause between polls) and keeps
  the worst latency seen, a failed or non-200 answer counting as an error;
- ``Bystander``: streams chat answers one after another with its own API key and keeps the
  worst gap between two received events, counted across streams (from sending a request to
  its first token, and from a stream's last token to the next stream's first), so a stall
  between two of its streams is seen as well as one inside a stream.

``with Watch(url, key=..., model=...) as w:`` starts both and returns once the bystander has
received its first token (it is streaming when the caller's request goes out); leaving the
block stops them. ``w.report()`` gives a ``WatchReport``; ``bounded_answer`` times one
request. The thresholds are the caller's (tests/reliability/conftest.py, the soak benchmark).

Hostile bodies' parts shared by the tests and the soak benchmark: ``failing_call_history``
(a chat whose tool result a ``failed_call`` edit reads), ``nested_array`` (a schema nested
``depth`` arrays deep) and ``function_tool``; ``long_input`` (a megabyte of text that is a
prompt within the test models' context) is shared with ``bench store-budget``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from leyline_agent.experiments.bench.store_budget import long_input

__all__ = [
    "ALICE",
    "ALICE_2",
    "Bystander",
    "HealthProbe",
    "KEYS",
    "MALLORY",
    "MALLORY_2",
    "TimedAnswer",
    "Watch",
    "WatchReport",
    "bounded_answer",
    "failing_call_history",
    "function_tool",
    "key_file_text",
    "long_input",
    "nested_array",
]

# Two tenants of two keys each: mallory sends hostile requests, alice is the bystander.
KEYS = {
    "mallory-key-1": "mallory",
    "mallory-key-2": "mallory",
    "alice-key-1": "alice",
    "alice-key-2": "alice",
}
MALLORY, MALLORY_2, ALICE, ALICE_2 = KEYS
HEALTH_PAUSE_S = 0.02
BYSTANDER_MAX_TOKENS = 32
START_TIMEOUT_S = 60.0


def key_file_text(keys: dict[str, str] = KEYS) -> str:
    """``--api-key-file`` contents: one ``KEY TENANT`` line per key."""
    return "".join(f"{k} {t}\n" for k, t in keys.items())


@dataclass(slots=True)
class WatchReport:
    """What the watchers saw: worst ``/health`` latency and worst bystander gap (seconds)."""

    health_worst_s: float
    health_polls: int
    health_errors: list[str]
    gap_worst_s: float
    tokens: int
    streams: int
    stream_errors: list[str]

    def problems(self, *, health_s: float, gap_s: float) -> list[str]:
        """Every way this report breaks the bounds (empty: none)."""
        out = [f"/health: {e}" for e in self.health_errors]
        out += [f"bystander: {e}" for e in self.stream_errors]
        if self.health_worst_s >= health_s:
            out.append(f"/health took {self.health_worst_s:.3f}s (bound {health_s}s)")
        if self.gap_worst_s >= gap_s:
            out.append(f"bystander's worst gap {self.gap_worst_s:.3f}s (bound {gap_s}s)")
        if self.health_polls < 1 or self.tokens < 2:
            out.append(f"too little watched: {self.health_polls} polls, {self.tokens} tokens")
        return out


class _Looper(threading.Thread):
    """A daemon thread running ``once()`` until ``stop()``; an exception ends it, recorded."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._stop_event = threading.Event()
        self.errors: list[str] = []

    def once(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.once()
            except Exception as e:  # noqa: BLE001 - recorded, the watcher reports it
                self.errors.append(f"{type(e).__name__}: {e}")
                self._stop_event.wait(0.1)

    def stop(self) -> None:
        self._stop_event.set()


class HealthProbe(_Looper):
    """Polls ``{url}/health``; ``worst_s`` is the slowest answer (a timeout counts in full)."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        super().__init__("reliability-health")
        self._client = httpx.Client(base_url=url, timeout=timeout)
        self.worst_s = 0.0
        self.polls = 0

    def once(self) -> None:
        t0 = time.monotonic()
        try:
            r = self._client.get("/health")
        finally:
            self.worst_s = max(self.worst_s, time.monotonic() - t0)
        self.polls += 1
        if r.status_code != 200:
            self.errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
        self._stop_event.wait(HEALTH_PAUSE_S)

    def run(self) -> None:
        try:
            super().run()
        finally:
            self._client.close()


class Bystander(_Looper):
    """Streams chats as ``key`` (one after another); ``worst_gap_s`` between two events.

    The clock starts when the first stream is sent; from then on every received token ends
    one gap and starts the next, across streams. ``started`` is set at the first token.
    """

    def __init__(
        self,
        url: str,
        *,
        key: str,
        model: str,
        prompt: str = "Count slowly from one to fifty.",
        max_tokens: int = BYSTANDER_MAX_TOKENS,
        timeout: float = 60.0,
    ) -> None:
        super().__init__("reliability-bystander")
        self._client = httpx.Client(
            base_url=url, timeout=timeout, headers={"Authorization": f"Bearer {key}"}
        )
        self._body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        self.started = threading.Event()
        self.worst_gap_s = 0.0
        self.tokens = 0
        self.streams = 0
        self._last: float | None = None

    def once(self) -> None:
        if self._last is None:
            self._last = time.monotonic()
        with self._client.stream("POST", "/v1/chat/completions", json=self._body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if '"error"' in line[:20]:
                    raise RuntimeError(f"stream error: {line[:200]}")
                now = time.monotonic()
                self.worst_gap_s = max(self.worst_gap_s, now - self._last)
                self._last = now
                self.tokens += 1
                self.started.set()
                if self._stop_event.is_set():
                    return
        self.streams += 1

    def run(self) -> None:
        try:
            super().run()
        finally:
            self._client.close()


@dataclass
class Watch:
    """Both watchers on one server, as a context manager (see the module docstring)."""

    url: str
    key: str
    model: str
    bystander_prompt: str = "Count slowly from one to fifty."
    start_timeout_s: float = START_TIMEOUT_S
    health: HealthProbe = field(init=False)
    bystander: Bystander = field(init=False)

    def __enter__(self) -> Self:
        self.health = HealthProbe(self.url)
        self.bystander = Bystander(
            self.url, key=self.key, model=self.model, prompt=self.bystander_prompt
        )
        self.health.start()
        self.bystander.start()
        if not self.bystander.started.wait(self.start_timeout_s):
            self.stop()
            raise TimeoutError(
                f"the bystander got no token in {self.start_timeout_s}s: {self.bystander.errors}"
            )
        return self

    def stop(self, timeout: float = 60.0) -> None:
        for t in (self.health, self.bystander):
            t.stop()
        for t in (self.health, self.bystander):
            t.join(timeout)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def report(self) -> WatchReport:
        h, b = self.health, self.bystander
        return WatchReport(
            health_worst_s=h.worst_s,
            health_polls=h.polls,
            health_errors=list(h.errors),
            gap_worst_s=b.worst_gap_s,
            tokens=b.tokens,
            streams=b.streams,
            stream_errors=list(b.errors),
        )


@dataclass(frozen=True, slots=True)
class TimedAnswer:
    """One request's answer and how long it took (``elapsed_s``; None: no answer)."""

    response: httpx.Response | None
    elapsed_s: float
    error: str | None = None

    @property
    def status(self) -> int | None:
        return None if self.response is None else self.response.status_code

    @property
    def error_field(self) -> str | None:
        """The ``error.param`` of an error answer (None when there is none)."""
        if self.response is None or self.response.status_code < 400:
            return None
        try:
            err = self.response.json().get("error") or {}
        except ValueError:
            return None
        return err.get("param") if isinstance(err, dict) else None


def bounded_answer(send: Callable[[], httpx.Response]) -> TimedAnswer:
    """Time ``send()``; a transport error (the client's own timeout) becomes ``error``."""
    t0 = time.monotonic()
    try:
        r = send()
    except httpx.HTTPError as e:
        return TimedAnswer(None, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    return TimedAnswer(r, time.monotonic() - t0)


_CALL = {"id": "call_1", "type": "function", "function": {"name": "run", "arguments": "{}"}}


def failing_call_history(result: str) -> list[dict[str, Any]]:
    """A chat in which the tool call ``call_1`` returned ``result`` and the agent moved on."""
    return [
        {"role": "user", "content": "Run it."},
        {"role": "assistant", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
        {"role": "assistant", "content": "It printed something."},
        {"role": "user", "content": "Go on."},
    ]


def nested_array(depth: int) -> dict[str, Any]:
    """A JSON schema of strings nested ``depth`` arrays deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def function_tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A chat request's function tool."""
    return {"type": "function", "function": {"name": name, "parameters": parameters}}
