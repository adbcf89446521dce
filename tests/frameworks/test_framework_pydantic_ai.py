"""pydantic-ai (``Agent`` + ``OpenAIChatModel``) against a real ``leyline serve`` on loopback.

The model is the tiny engine answering a script (``ScriptedEngine``: a random-weight model
cannot drive a tool loop; it replays the script per conversation, so concurrent runs each get
the whole loop). The loop, the tool calls' parsing and execution and the history edits are
pydantic-ai's own. Every test runs three conversations at once on one agent, one model, one
client (``asyncio.gather`` of ``agent.run``), the case that gave one session per client 14
resets in 15 turns:
- ``LeylineTransport`` (stale-tool) in the provider's ``http_client``: three sessions, no
  resets, each forwards its own edits as directives;
- pydantic-ai's own ``ProcessHistory`` capability (``history_processors=`` in v1) stubbing old
  tool returns, on a plain client: the server finds each conversation by content and splices
  (``--client-edits amortize``), or serves exactly what was sent (``off``).
Each checks the server's splices (``/leyline/v1/stats``) and that the engine's prompts are the
tokenizer's template on exactly what pydantic-ai sent (recorded by an httpx hook), after edits.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import httpx
import pydantic_ai  # noqa: E402, F401  -- the frameworks extra (scripts/setup.sh): fail, never skip
import pytest
from pydantic_ai import Agent, ModelRequest, ModelResponse, ToolCallPart, ToolReturnPart  # noqa: E402
from pydantic_ai.capabilities import ProcessHistory  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

from leyline_agent.agent.transport import LeylineTransport  # noqa: E402
from leyline_agent.testing.frameworks import (  # noqa: E402
    Recorder,
    rendered,
    scripted_server,
    stale_tool_results,
    stats,
)
from leyline_agent.testing.scripted_engine import tool_call  # noqa: E402

# pydantic-ai 2.x prefers httpx2 clients; LeylineTransport is an httpx one (still accepted)
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:`httpx.AsyncClient` support:UserWarning")]

N_CALLS = 4
KEEP = 2
RUNS = 3
CLEARED = "[cleared]"
SCRIPT = [tool_call("read_file", {"path": f"f{k}.py"}) for k in range(N_CALLS)] + ["All read."]
PROMPTS = [f"read four files of project {name}" for name in ("alpha", "beta", "gamma")][:RUNS]


def read_file(path: str) -> str:
    """Read a file."""
    return " ".join(f"{path}:{j} value={j}" for j in range(30))


def clear_old_tool_returns(messages: list) -> list:
    """A pydantic-ai history processor: tool returns of all but the newest ``KEEP``
    tool-calling responses become ``[cleared]`` (new message objects, as pydantic-ai asks)."""
    turns = [m for m in messages if isinstance(m, ModelResponse) and m.tool_calls]
    old = {p.tool_call_id for m in turns[: max(0, len(turns) - KEEP)] for p in m.tool_calls}

    def part(p):
        if isinstance(p, ToolReturnPart) and p.tool_call_id in old:
            return dataclasses.replace(p, content=CLEARED)
        return p

    return [
        dataclasses.replace(m, parts=[part(p) for p in m.parts])
        if isinstance(m, ModelRequest)
        else m
        for m in messages
    ]


def run_three(agent: Agent) -> None:
    async def go():
        return await asyncio.gather(*(agent.run(p) for p in PROMPTS))

    results = asyncio.run(go())
    assert [r.output for r in results] == ["All read."] * RUNS
    for r in results:  # pydantic-ai's own tool loop ran each conversation to its end
        calls = [p for m in r.all_messages() if isinstance(m, ModelResponse) for p in m.parts]
        assert sum(isinstance(p, ToolCallPart) for p in calls) == N_CALLS


def agent_on(srv, engine, http_client, **kw) -> Agent:
    provider = OpenAIProvider(base_url=srv.base_url, api_key="none", http_client=http_client)
    model = OpenAIChatModel(engine.model_name, provider=provider)
    return Agent(model, instructions="Read what you are asked to.", tools=[read_file], **kw)


def conversation(body) -> str:
    [user] = [m["content"] for m in body["messages"] if m["role"] == "user"]
    return user if isinstance(user, str) else "".join(p["text"] for p in user)


def tool_contents(body):
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


def as_multiset(prompts) -> Counter:
    return Counter(tuple(p) for p in prompts)


def test_three_concurrent_runs_on_one_transport_each_get_their_own_directives():
    with scripted_server(SCRIPT, client_edits="off") as (srv, engine):
        t = LeylineTransport([{"name": "stale-tool", "keep": KEEP}])
        rec = Recorder()
        agent = agent_on(
            srv, engine, httpx.AsyncClient(transport=t, event_hooks={"request": [rec.hook]})
        )
        run_three(agent)
        bodies = rec.bodies
        assert Counter(conversation(b) for b in bodies) == {p: N_CALLS + 1 for p in PROMPTS}
        sessions = t.sessions
        assert len(sessions) == RUNS
        for s in sessions:  # one session per conversation, each with its own directives
            assert s.stats.turns == N_CALLS + 1
            assert s.stats.resets == 0
            assert s.stats.replaced_replies == 0  # its re-serialized echoes are the replies
            assert s.stats.forwarded_edits == N_CALLS - KEEP
            assert s.stats.server_fallbacks == 0
        # each served prompt is the stale-tool edit of one body pydantic-ai sent
        tok = engine.tokenizer
        expected = [
            rendered(tok, {**b, "messages": stale_tool_results(b["messages"])}) for b in bodies
        ]
        assert as_multiset(engine.prompts) == as_multiset(expected)
        # the server spliced every session's directives: the sum of what each forwarded
        s = stats(srv)
        assert s["splices"]["amortize"] == sum(x.stats.forwarded_edits for x in sessions), s
        assert s["fallbacks"] == 0, s


@pytest.mark.parametrize("client_edits", ["amortize", "off"])
def test_process_history_on_a_plain_client_is_spliced_by_the_server(client_edits):
    with scripted_server(SCRIPT, client_edits=client_edits) as (srv, engine):
        rec = Recorder()
        agent = agent_on(
            srv, engine, httpx.AsyncClient(event_hooks={"request": [rec.hook]}),
            capabilities=[ProcessHistory(clear_old_tool_returns)],
        )  # fmt: skip
        run_three(agent)
        bodies = rec.bodies
        assert Counter(conversation(b) for b in bodies) == {p: N_CALLS + 1 for p in PROMPTS}
        # pydantic-ai's processor, as sent: all but the newest KEEP tool returns cleared
        for p in PROMPTS:
            mine = [b for b in bodies if conversation(b) == p]
            for k, body in enumerate(mine):
                assert tool_contents(body).count(CLEARED) == max(0, k - KEEP)
        # served exactly what pydantic-ai sent, in either mode
        assert as_multiset(engine.prompts) == as_multiset(
            rendered(engine.tokenizer, b) for b in bodies
        )
        s = stats(srv)
        want = RUNS * (N_CALLS - KEEP) if client_edits == "amortize" else 0
        assert s["splices"]["amortize"] == want, s
