"""LangChain 1.x (``create_agent`` + ``ChatOpenAI``) against a real ``leyline serve`` on loopback.

The model is the tiny engine answering a script (``ScriptedEngine``: a random-weight model
cannot drive a tool loop; the tool loop, the tool calls' parsing and execution, and the edits
are LangChain's own). Two recipes:
- LangChain's own ``ContextEditingMiddleware(ClearToolUsesEdit)`` with a plain ``ChatOpenAI``:
  the server splices the client-made edits (``--client-edits amortize``);
- Leyline's policies through ``LeylineTransport`` given once to ``http_client`` and once to
  ``http_async_client`` (the async path is what ``ainvoke`` uses).
Each checks that splices happened (``/leyline/v1/stats``) and that the engine's prompts are the
tokenizer's template on exactly what LangChain sent (recorded by an httpx hook), after edits.
"""

from __future__ import annotations

import asyncio

import httpx
import langchain  # noqa: E402, F401  -- the frameworks extra (scripts/setup.sh): fail, never skip
from langchain.agents import create_agent  # noqa: E402
from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

from leyline_agent.agent.transport import LeylineTransport  # noqa: E402
from leyline_agent.testing.frameworks import (  # noqa: E402
    Recorder,
    rendered,
    scripted_server,
    stale_tool_results,
    stats,
)
from leyline_agent.testing.scripted_engine import tool_call  # noqa: E402

N_CALLS = 4
SCRIPT = [tool_call("read_file", {"path": f"f{k}.py"}) for k in range(N_CALLS)] + ["All read."]


@tool
def read_file(path: str) -> str:
    """Read a file."""
    return " ".join(f"{path}:{j} value={j}" for j in range(30))


def tool_contents(body):
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


def test_clear_tool_uses_edit_is_spliced_by_the_server():
    with scripted_server(SCRIPT, client_edits="amortize") as (srv, engine):
        rec = Recorder()
        llm = ChatOpenAI(
            model=engine.model_name, base_url=srv.base_url, api_key="none", max_retries=0,
            http_client=httpx.Client(event_hooks={"request": [rec]}),
        )  # fmt: skip
        edit = ClearToolUsesEdit(trigger=0, keep=2)
        agent = create_agent(
            llm, tools=[read_file], middleware=[ContextEditingMiddleware(edits=[edit])]
        )
        out = agent.invoke({"messages": [{"role": "user", "content": "read four files"}]})
        assert out["messages"][-1].content == "All read."
        bodies = rec.bodies
        assert len(bodies) == N_CALLS + 1
        # LangChain's own edit: all but the newest 2 tool results are "[cleared]"
        for k, body in enumerate(bodies):
            assert tool_contents(body).count("[cleared]") == max(0, k - 2)
        # what was served is what LangChain sent (its edits included)
        tok = engine.tokenizer
        assert engine.prompts == [rendered(tok, b) for b in bodies]
        # and the server spliced each newly cleared result in place
        s = stats(srv)
        assert s["splices"]["amortize"] == N_CALLS + 1 - 3, s


def test_transport_in_http_client_and_http_async_client():
    with scripted_server(SCRIPT, client_edits="off") as (srv, engine):
        t = LeylineTransport([{"name": "stale-tool", "keep": 2}])
        rec = Recorder()
        llm = ChatOpenAI(
            model=engine.model_name, base_url=srv.base_url, api_key="none", max_retries=0,
            http_client=httpx.Client(transport=t),
            http_async_client=httpx.AsyncClient(transport=t, event_hooks={"request": [rec.hook]}),
        )  # fmt: skip
        agent = create_agent(llm, tools=[read_file])
        out = asyncio.run(
            agent.ainvoke({"messages": [{"role": "user", "content": "read four files"}]})
        )
        assert out["messages"][-1].content == "All read."
        assert len(rec.bodies) == N_CALLS + 1
        [session] = t.sessions
        assert session.stats.resets == 0
        assert session.stats.forwarded_edits == N_CALLS - 2
        tok = engine.tokenizer
        assert engine.prompts == [
            rendered(tok, {**b, "messages": stale_tool_results(b["messages"])}) for b in rec.bodies
        ]
        s = stats(srv)
        assert s["splices"]["amortize"] == N_CALLS - 2, s
