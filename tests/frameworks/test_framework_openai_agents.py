"""The OpenAI Agents SDK (``Runner`` + ``OpenAIChatCompletionsModel``) against a real
``leyline serve`` on loopback, with the SDK's own ``ToolOutputTrimmer``.

The model is the tiny engine answering a script (``ScriptedEngine``: a random-weight model
cannot drive a tool loop); the loop, the tool execution, the conversation carried across
three user turns and the trimming are the SDK's. The client is a plain ``AsyncOpenAI`` (no
wrapper): the server finds the conversation by content and splices the trimmer's in-place
edits itself (``--client-edits amortize``). Checks:
splices in ``/leyline/v1/stats``, and the engine's prompts are the tokenizer's template on
exactly what the SDK sent (recorded by an httpx hook), trimmed outputs included.
"""

from __future__ import annotations

import asyncio

import agents  # noqa: E402, F401  -- the frameworks extra (scripts/setup.sh): fail, never skip
import httpx
from agents import (  # noqa: E402
    Agent,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.extensions import ToolOutputTrimmer  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from leyline_agent.testing.frameworks import Recorder, rendered, scripted_server, stats  # noqa: E402
from leyline_agent.testing.scripted_engine import tool_call  # noqa: E402

USER_TURNS = 3
SCRIPT = [
    t
    for k in range(USER_TURNS)
    for t in (tool_call("read_file", {"path": f"f{k}.py"}), f"Read f{k}.")
]


@function_tool
def read_file(path: str) -> str:
    """Read a file."""
    return "\n".join(f"{path} line {j}: value = {j * 7}" for j in range(30))


def test_tool_output_trimmer_is_spliced_by_the_server():
    set_tracing_disabled(True)
    with scripted_server(SCRIPT, client_edits="amortize") as (srv, engine):
        rec = Recorder()
        client = AsyncOpenAI(
            base_url=srv.base_url, api_key="none", max_retries=0,
            http_client=httpx.AsyncClient(event_hooks={"request": [rec.hook]}),
        )  # fmt: skip
        agent = Agent(
            name="reader", instructions="Read what you are asked to.", tools=[read_file],
            model=OpenAIChatCompletionsModel(model=engine.model_name, openai_client=client),
        )  # fmt: skip
        trimmer = ToolOutputTrimmer(recent_turns=1, max_output_chars=200, preview_chars=20)

        async def run():
            items: list = []
            for k in range(USER_TURNS):
                items = [*items, {"role": "user", "content": f"read f{k}.py"}]
                result = await Runner.run(
                    agent, items, run_config=RunConfig(call_model_input_filter=trimmer)
                )
                assert result.final_output == f"Read f{k}."
                items = result.to_input_list()

        asyncio.run(run())
        bodies = rec.bodies
        assert len(bodies) == 2 * USER_TURNS
        # the SDK's trimmer shortened the outputs of older user turns (never the newest)
        lengths = [
            [len(m["content"]) for m in b["messages"] if m["role"] == "tool"] for b in bodies
        ]
        full = len(read_file_text("f0.py"))
        assert lengths[1] == [full]
        assert all(n < full for n in lengths[-1][:-1]) and lengths[-1][-1] == full
        # served exactly what the SDK sent
        assert engine.prompts == [rendered(engine.tokenizer, b) for b in bodies]
        # each newly trimmed output spliced in place (one per later user turn)
        s = stats(srv)
        assert s["splices"]["amortize"] == USER_TURNS - 1, s


def read_file_text(path: str) -> str:
    return "\n".join(f"{path} line {j}: value = {j * 7}" for j in range(30))
