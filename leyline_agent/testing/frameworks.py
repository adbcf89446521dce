"""What the agent-framework tests share (``tests/frameworks/test_framework_*.py``).

``scripted_server(script, client_edits=..., paths=...)``: a real ``leyline serve`` app on
loopback whose tiny engine answers the script (``ScriptedEngine``); yields ``(server,
engine)``; ``paths``, a list, receives the path of every HTTP request the server gets (to
count directive requests), ``statuses`` its ``(path, status)``.
``Recorder``: an httpx request hook that keeps every ``/chat/completions`` body as the
framework built it (before any transport: httpx runs request hooks first).
``rendered(tok, body)``: the prompt of a chat body by the tokenizer's own chat template (an
independent rendering of what was sent). ``stale_tool_results(messages, keep)``: Leyline's
stale-tool rule computed here, independently of ``policies``, for the expected prompts.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx

from leyline_agent.testing.scripted_engine import ScriptedEngine
from leyline_agent.testing.server import ThreadServer, serve_in_thread

__all__ = ["Recorder", "rendered", "scripted_server", "stale_tool_results", "stats"]

ARCH = "deepseek_v2"


@contextlib.contextmanager
def scripted_server(
    script: Sequence[str],
    *,
    client_edits: str = "amortize",
    paths: list[str] | None = None,
    statuses: list[tuple[str, int]] | None = None,
) -> Iterator[tuple[ThreadServer, ScriptedEngine]]:
    from leyline_agent.engine.checkpoints.store import tiny_model_dir
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    engine = ScriptedEngine(Engine.from_pretrained(tiny_model_dir(ARCH)), script)
    app = create_app(engine, client_edits=client_edits)
    if paths is not None or statuses is not None:

        @app.middleware("http")
        async def record(request: Any, call_next: Any) -> Any:
            if paths is not None:
                paths.append(request.url.path)
            response = await call_next(request)
            if statuses is not None:
                statuses.append((request.url.path, response.status_code))
            return response

    with serve_in_thread(app) as srv:
        yield srv, engine


def stats(srv: ThreadServer) -> dict[str, Any]:
    return httpx.get(f"{srv.url}/leyline/v1/stats", timeout=30).json()


class Recorder:
    """``event_hooks={"request": [rec]}`` (sync) or ``[rec.hook]`` (async): chat bodies sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.read()))

    async def hook(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(await request.aread()))


def rendered(tok: Any, body: dict[str, Any]) -> list[int]:
    """The prompt of a chat body by the tokenizer's own template (messages as sent)."""
    messages = [_plain(m) for m in body["messages"]]
    tools = [_tool(t) for t in body["tools"]] if body.get("tools") else None
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def _tool(t: dict[str, Any]) -> dict[str, Any]:
    """A tool as the server renders it (docs/server.md: ``strict`` and unknown keys dropped)."""
    fn = t["function"]
    keep = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
    return {"type": "function", "function": keep}


def _plain(m: dict[str, Any]) -> dict[str, Any]:
    """Text parts joined (as the server's canonical form does); tool-call arguments parsed
    back to the objects the template expects where it renders them."""
    m = dict(m)
    if isinstance(m.get("content"), list):
        m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
    if m.get("role") == "developer":
        m["role"] = "system"
    return m


def edited(body: dict[str, Any], edit: Callable[[list[dict]], list[dict]]) -> dict[str, Any]:
    return {**body, "messages": edit(body["messages"])}


def stale_tool_results(
    messages: list[dict[str, Any]], keep: int = 2, stub: str = "[stale output of {tool} elided]"
) -> list[dict[str, Any]]:
    """The results of all but the newest ``keep`` tool-calling turns replaced by ``stub``
    (naming the tool), as the stale-tool policy's default does."""
    turns = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    names = {
        tc["id"]: tc["function"]["name"]
        for m in turns[: max(0, len(turns) - keep)]
        for tc in m["tool_calls"]
    }
    return [
        {**m, "content": stub.format(tool=names[m["tool_call_id"]])}
        if m["role"] == "tool" and m.get("tool_call_id") in names else m
        for m in messages
    ]  # fmt: skip
