"""The OpenAI Agents SDK on its default model class (``OpenAIResponsesModel``: the Responses
API) with ``LeylineTransport(stale-tool)``, and with a ``wrap_openai`` client, against a real
``leyline serve`` app on loopback.

The model is the tiny engine answering a script (``ScriptedEngine``) of seven tool calls and
an answer, so one ``Runner.run`` is a tool loop long enough for stale-tool (keep 2) to act.
The same loop runs on fresh servers with the policy (through each wrapper) and, once, without
one (``LeylineTransport([])``, the SDK's requests as built). Checks: the Responses bodies the
server got carry stale-tool's stubs in their ``function_call_output`` items, exactly where
stale-tool's rule (computed here) puts them; the server spliced each newly stale result
(AMORTIZE count in ``/leyline/v1/stats``, at least 3); the edited loop prefilled at most
1.10x the tokens of the unedited one; nothing failed in the transport.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import agents  # noqa: F401  -- the frameworks extra (scripts/setup.sh): fail, never skip
import httpx
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from leyline_agent import wrap_openai
from leyline_agent.agent.transport import LeylineTransport
from leyline_agent.testing.frameworks import scripted_server, stats
from leyline_agent.testing.scripted_engine import tool_call

pytestmark = pytest.mark.slow

CALLS, KEEP = 7, 2
SCRIPT = [*(tool_call("read_file", {"path": f"f{k}.py"}) for k in range(CALLS)), "Read them all."]
STUB = "[stale output of read_file elided]"


@function_tool
def read_file(path: str) -> str:
    """Read a file."""
    return "\n".join(f"{path} line {j}: value = {j * 7}" for j in range(30))


class Forwarded(httpx.AsyncBaseTransport):
    """Below ``LeylineTransport``: keeps every Responses body as it leaves for the server."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/responses"):
            self.bodies.append(json.loads(await request.aread()))
        return await self.inner.handle_async_request(request)


def run_loop(policies: list, wrapper: str = "transport") -> tuple[dict, list[dict], Any]:
    """One agent run on a fresh server: its stats, the bodies it got, the wrapper's state
    (``failures``): ``LeylineTransport`` or ``wrap_openai``."""
    forwarded = Forwarded()
    with scripted_server(SCRIPT) as (srv, engine):
        if wrapper == "transport":
            state = LeylineTransport(policies, async_transport=forwarded)
            http = httpx.AsyncClient(transport=state)
            client = AsyncOpenAI(base_url=srv.base_url, api_key="none", max_retries=0, http_client=http)  # fmt: skip
        else:
            http = httpx.AsyncClient(transport=forwarded)
            plain = AsyncOpenAI(base_url=srv.base_url, api_key="none", max_retries=0, http_client=http)  # fmt: skip
            client = wrap_openai(plain, policies)
            state = client.leyline
        agent = Agent(
            name="reader", instructions="Read the files you are asked to.", tools=[read_file],
            model=OpenAIResponsesModel(model=engine.model_name, openai_client=client),
        )  # fmt: skip

        async def run() -> None:
            result = await Runner.run(agent, "read the files", max_turns=CALLS + 2)
            assert result.final_output == "Read them all."

        asyncio.run(run())
        counts = stats(srv)
    return counts, forwarded.bodies, state


@functools.cache
def unedited() -> tuple[dict, list[dict]]:
    """The loop without a policy (``LeylineTransport([])``), run once for both wrappers."""
    counts, bodies, _ = run_loop([])
    return counts, bodies


def stale_outputs(items: list[dict]) -> list[int]:
    """Indices (among the function_call_output items) stale-tool keeps whole: the newest KEEP."""
    n = sum(1 for i in items if i.get("type") == "function_call_output")
    return list(range(max(0, n - KEEP), n))


@pytest.mark.parametrize("wrapper", ["transport", "wrap_openai"])
def test_stale_tool_splices_on_the_responses_api(wrapper):
    set_tracing_disabled(True)
    edited, bodies, state = run_loop([{"name": "stale-tool", "keep": KEEP}], wrapper)
    plain, plain_bodies = unedited()
    assert state.failures == 0
    assert len(bodies) == len(plain_bodies) == CALLS + 1
    for body in bodies:
        outputs = [i["output"] for i in body["input"] if i.get("type") == "function_call_output"]
        kept = stale_outputs(body["input"])
        assert all((o == STUB) == (k not in kept) for k, o in enumerate(outputs)), outputs
    assert edited["splices"]["amortize"] >= 3, edited
    assert edited["splices"]["amortize"] == CALLS - KEEP, edited  # one per newly stale result
    assert plain["splices"]["amortize"] == 0
    assert edited["prefilled_tokens"] <= 1.10 * plain["prefilled_tokens"], (edited, plain)
