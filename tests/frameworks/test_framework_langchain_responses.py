"""LangChain's ``ChatOpenAI(use_responses_api=True)`` through ``LeylineTransport(stale-tool)``
against a real ``leyline serve`` app (tiny engine answering a script of five tool calls).

LangChain sends ``/v1/responses`` requests holding the whole history as items; the transport
reads them as chat messages, stubs stale tool results in the items, and the server splices.
Checks: no transport failure, the bodies the server got carry the stubs where stale-tool's
rule (keep 2) puts them, and one AMORTIZE splice per newly stale result.
"""

from __future__ import annotations

import json

import httpx
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from leyline_agent import LeylineTransport
from leyline_agent.testing.frameworks import scripted_server, stats
from leyline_agent.testing.scripted_engine import tool_call

pytestmark = pytest.mark.slow

CALLS, KEEP = 5, 2
STUB = "[stale output of read_file elided]"


@tool
def read_file(path: str) -> str:
    """Read a file."""
    return f"{path} body " * 30


class Forwarded(httpx.BaseTransport):
    def __init__(self) -> None:
        self.inner, self.bodies = httpx.HTTPTransport(), []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/responses"):
            self.bodies.append(json.loads(request.read()))
        return self.inner.handle_request(request)


def test_use_responses_api_is_spliced_through_the_transport():
    script = [*(tool_call("read_file", {"path": f"f{k}"}) for k in range(CALLS)), "done"]
    forwarded = Forwarded()
    with scripted_server(script) as (srv, engine):
        t = LeylineTransport([{"name": "stale-tool", "keep": KEEP}], transport=forwarded)
        llm = ChatOpenAI(
            model=engine.model_name, base_url=srv.base_url, api_key="none", max_retries=0,
            use_responses_api=True, http_client=httpx.Client(transport=t),
        ).bind_tools([read_file])  # fmt: skip
        messages: list = [HumanMessage("read the files")]
        for _ in range(CALLS + 1):
            ai = llm.invoke(messages)
            messages.append(ai)
            for c in ai.tool_calls:
                messages.append(ToolMessage(read_file.invoke(c["args"]), tool_call_id=c["id"]))
        counts = stats(srv)
    assert t.failures == 0
    assert len(forwarded.bodies) == CALLS + 1 and ai.content and not ai.tool_calls
    for body in forwarded.bodies:
        outputs = [i["output"] for i in body["input"] if i.get("type") == "function_call_output"]
        assert [o == STUB for o in outputs] == [
            k < len(outputs) - KEEP for k in range(len(outputs))
        ]
    assert counts["splices"]["amortize"] == CALLS - KEEP
