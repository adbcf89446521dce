"""The self-editing table: every client set-up in front of a self-editing loop splices.

A loop that edits its own history (it stubs the results of all but its newest ``KEEP`` tool
calls in place before each call, as LangChain's ``ClearToolUsesEdit``, the Agents SDK's
``ToolOutputTrimmer`` and mini-swe-agent do) runs ``TURNS`` turns over HTTP (the real
``openai`` SDK, a real ``leyline serve`` on loopback, a tiny checkpoint with hand-set weights
that answers a tool-calling script) behind each client set-up:

- no wrapper; ``LeylineTransport([])``; ``wrap_openai(stale-tool)``; ``LeylineTransport(stale-tool)``.

For each, the test measures the row of the table (splices and prefilled tokens from
``/leyline/v1/stats``; the agent side's resets and failures), prints it, and asserts: the
server spliced, the client side counted no failure, no session reset (a reset would name a new
session and lose the splices silently), and the prefill is at most 1.10x the same loop's
without any edit (measured on its own fresh server in the same run). The bound can fail: the
same edits served exactly (``--client-edits off``) re-prefill far more.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from leyline_agent.agent.transport import LeylineTransport
from leyline_agent.agent.wrappers import leyline_state, wrap_openai
from leyline_agent.testing.frameworks import scripted_server, stats
from leyline_agent.testing.scripted_engine import tool_call

pytestmark = pytest.mark.slow

TURNS = 7
KEEP = 2
SCRIPT = [tool_call("read_file", {"path": f"f{k}.py"}) for k in range(TURNS - 1)] + ["All read."]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
STALE = [{"name": "stale-tool", "keep": KEEP}]
SETUPS = ["no wrapper", "LeylineTransport([])", "wrap_openai(stale-tool)", "LeylineTransport(stale-tool)"]  # fmt: skip
TABLE: dict[str, dict[str, Any]] = {}


def _client(setup: str, base_url: str) -> tuple[openai.OpenAI, Any]:
    """The client for ``setup`` and the agent-side object whose counters it reports."""
    kw: dict[str, Any] = {"base_url": base_url, "api_key": "none", "max_retries": 0}
    if setup == "no wrapper":
        return openai.OpenAI(**kw), None
    if setup == "wrap_openai(stale-tool)":
        client = wrap_openai(openai.OpenAI(**kw), STALE)
        return client, leyline_state(client)
    transport = LeylineTransport([] if setup == "LeylineTransport([])" else STALE)
    return openai.OpenAI(**kw, http_client=httpx.Client(transport=transport)), transport


def _loop(client: openai.OpenAI, model: str, edit: bool) -> None:
    history: list[dict] = [
        {"role": "system", "content": "You read files."},
        {"role": "user", "content": "Read the files."},
    ]
    for _ in range(TURNS):
        if edit:
            results = [m for m in history if m["role"] == "tool"]
            for m in results[: max(0, len(results) - KEEP)]:
                m["content"] = "[cleared]"
        r = client.chat.completions.create(
            model=model, messages=history, tools=TOOLS, max_tokens=64
        )
        msg = r.choices[0].message.model_dump(exclude_none=True)
        history.append(msg)
        for tc in msg.get("tool_calls") or ():
            path = json.loads(tc["function"]["arguments"])["path"]
            content = " ".join(f"{path}:{j} value={j * 7}" for j in range(40))
            history.append({"role": "tool", "tool_call_id": tc["id"], "content": content})
    assert history[-1]["content"] == "All read.", history[-1]


def _agent_counters(side: Any) -> tuple[int, int, int]:
    """(sessions, resets, failures) on the agent side; a plain client has one and none."""
    if side is None:
        return 1, 0, 0
    sessions = list(side.sessions.values()) if isinstance(side.sessions, dict) else side.sessions
    resets = sum(s.stats.resets for s in sessions)
    failures = sum(s.stats.runtime_failures for s in sessions) + getattr(side, "failures", 0)
    return len(sessions), resets, failures


def _run(setup: str, edit: bool, client_edits: str = "amortize") -> dict[str, Any]:
    with scripted_server(SCRIPT, client_edits=client_edits) as (srv, engine):
        client, side = _client(setup, srv.base_url)
        _loop(client, engine.model_name, edit)
        s = stats(srv)
    sessions, resets, failures = _agent_counters(side)
    return {"splices": s["splices"]["amortize"] + s["splices"].get("forget", 0),
            "prefilled": s["prefilled_tokens"], "sessions": sessions, "resets": resets,
            "failures": failures}  # fmt: skip


@pytest.fixture(scope="module")
def unedited() -> int:
    got = _run("no wrapper", edit=False)
    TABLE["unedited loop"] = got
    return got["prefilled"]


@pytest.mark.parametrize("setup", SETUPS)
def test_the_setup_splices_the_loops_edits_with_no_reset(setup, unedited):
    got = _run(setup, edit=True)
    TABLE[setup] = got
    print("\n| client in front | splices | prefilled (7 turns) | sessions | resets | failures |")
    for name, row in TABLE.items():
        print(f"| {name} | {row['splices']} | {row['prefilled']} | {row['sessions']} "
              f"| {row['resets']} | {row['failures']} |")  # fmt: skip
    assert got["splices"] > 0, got
    assert got["splices"] >= TURNS - 1 - KEEP, got  # every newly cleared result
    assert got["failures"] == 0, got
    assert got["resets"] == 0 and got["sessions"] == 1, got
    assert got["prefilled"] <= 1.10 * unedited, (got, unedited)


def test_the_bound_fails_without_splices(unedited):
    got = _run("no wrapper", edit=True, client_edits="off")
    assert got["splices"] == 0, got
    assert got["prefilled"] > 1.10 * unedited, (got, unedited)
