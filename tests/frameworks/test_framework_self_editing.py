"""A loop that edits its own history keeps its splices whatever client sits in front of it.

The loop (the real ``openai`` SDK, tool calls parsed by the server) stubs the results of all
but its newest ``KEEP`` tool calls in place before every call, as LangChain's
``ClearToolUsesEdit`` does; LangChain's own middleware runs the same way below. Behind each
client set-up it runs against a fresh ``leyline serve`` (tiny DeepSeek-V2 engine answering a
tool-calling script, ``--client-edits amortize`` as ``leyline serve`` defaults to):

- no wrapper; ``LeylineTransport([])``; ``wrap_openai(stale-tool)``; ``LeylineTransport(stale-tool)``.

Each must splice (``/leyline/v1/stats``), prefill no more than 1.10x the tokens of the same
loop without any edit (its own fresh server: a prefix cache serves each turn's growth only),
and send no request to ``/leyline/v1/directives`` (the edits ride in the chat requests).
Without splices, every edit re-prefills the prompt from the edited message on: the bound
fails by far (checked: the same loop with ``client_edits="off"``).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from leyline_agent.agent.transport import LeylineTransport
from leyline_agent.agent.wrappers import wrap_openai
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
SETUPS = ["no wrapper", "LeylineTransport([])", "wrap_openai(stale-tool)", "LeylineTransport(stale-tool)"]  # fmt: skip


def _client(setup: str, base_url: str) -> openai.OpenAI:
    kw = {"base_url": base_url, "api_key": "none", "max_retries": 0}
    if setup == "no wrapper":
        return openai.OpenAI(**kw)
    if setup == "wrap_openai(stale-tool)":
        return wrap_openai(openai.OpenAI(**kw), [{"name": "stale-tool", "keep": KEEP}])
    policies = [] if setup == "LeylineTransport([])" else [{"name": "stale-tool", "keep": KEEP}]
    return openai.OpenAI(**kw, http_client=httpx.Client(transport=LeylineTransport(policies)))


def _loop(client: openai.OpenAI, model: str, edit: bool) -> list[dict]:
    history: list[dict] = [
        {"role": "system", "content": "You read files."},
        {"role": "user", "content": "Read the files."},
    ]
    for _ in range(TURNS):
        if edit:  # the loop's own edit: all but the newest KEEP results cleared, in place
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
    assert history[-1]["content"] == "All read."
    return history


def _run(setup: str, edit: bool, client_edits: str = "amortize") -> dict:
    paths: list[str] = []
    with scripted_server(SCRIPT, client_edits=client_edits, paths=paths) as (srv, engine):
        _loop(_client(setup, srv.base_url), engine.model_name, edit)
        s = stats(srv)
    return {"splices": s["splices"]["amortize"], "prefilled": s["prefilled_tokens"],
            "directive_requests": sum(p.endswith("/directives") for p in paths)}  # fmt: skip


@pytest.fixture(scope="module")
def unedited() -> int:
    return _run("no wrapper", edit=False)["prefilled"]


@pytest.mark.parametrize("setup", SETUPS)
def test_every_client_setup_splices_the_loops_own_edits(setup, unedited):
    got = _run(setup, edit=True)
    print(f"{setup}: {got}, unedited prefill {unedited}")
    assert got["splices"] >= TURNS - 1 - KEEP, got  # every newly cleared result, spliced
    assert got["prefilled"] <= 1.10 * unedited, (got, unedited)
    assert got["directive_requests"] == 0, got


def test_without_splices_the_bound_fails(unedited):
    """The bound can fail: the same edits served exactly (no splices) re-prefill."""
    got = _run("no wrapper", edit=True, client_edits="off")
    assert got["splices"] == 0
    assert got["prefilled"] > 1.10 * unedited, (got, unedited)


@pytest.mark.parametrize("setup", SETUPS[2:])
def test_the_policies_edits_ride_in_the_chat_requests(setup, unedited):
    """The loop edits nothing; the wrapper's stale-tool policy does: spliced in the chat
    requests' own jobs, with no directive request."""
    got = _run(setup, edit=False)
    assert got["splices"] >= TURNS - 1 - KEEP, got
    assert got["prefilled"] <= 1.10 * unedited, (got, unedited)
    assert got["directive_requests"] == 0, got
