"""What the agent-framework tests share (``tests/test_framework_*.py``).

``scripted_server(script, client_edits=...)``: a real ``leyline serve`` app on loopback whose
tiny engine answers the script (``ScriptedEngine``); yields ``(server, engine)``.
``Recorder``: an httpx request hook that keeps every ``/chat/completions`` body as the
framework built it (before any transport: httpx runs request hooks first).
``served_prompts_match(engine, tok, bodies, edit)``: the prompts the engine was given are the
tokenizer's own chat template on ``edit(body)`` (an independent rendering), turn by turn.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx

from leyline_agent.testing.scripted_engine import ScriptedEngine
from leyline_agent.testing.server import ThreadServer, serve_in_thread

__all__ = ["Recorder", "rendered", "scripted_server", "stats"]

ARCH = "deepseek_v2"


@contextlib.contextmanager
def scripted_server(
    script: Sequence[str], *, client_edits: str = "amortize"
) -> Iterator[tuple[ThreadServer, ScriptedEngine]]:
    from leyline_agent.engine.checkpoints.store import tiny_model_dir
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    engine = ScriptedEngine(Engine.from_pretrained(tiny_model_dir(ARCH)), script)
    with serve_in_thread(create_app(engine, client_edits=client_edits)) as srv:
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
    """A tool as the server renders it (README: ``strict`` and unknown keys dropped)."""
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
