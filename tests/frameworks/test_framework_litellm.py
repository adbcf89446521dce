"""LiteLLM (``litellm.completion``) against a real ``leyline serve`` on loopback.

LiteLLM has no agent loop of its own: the loop here calls ``litellm.completion``, executes
the tool calls LiteLLM parsed from the reply, and appends the messages as a LiteLLM user
does (the reply's ``Message`` object itself, then the tool results). The model is the tiny
engine answering a script (``ScriptedEngine``: a random-weight model cannot drive a tool
loop). Two recipes:
- the loop itself stubs old tool results (as LangChain's middleware does) on a plain
  ``openai.OpenAI`` client handed to LiteLLM: the server splices (``--client-edits amortize``);
- ``LeylineTransport`` in that client's ``http_client``: LiteLLM calls
  ``with_raw_response``, which still passes through the transport, so the reply is observed
  and the stale-tool edits go as directives (no resets).
Each checks splices (``/leyline/v1/stats``) and that the engine's prompts are the
tokenizer's template on exactly what LiteLLM sent (recorded by an httpx hook), after edits.
"""

from __future__ import annotations

import json
import os

import httpx

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the cost map
import litellm  # noqa: E402  -- the frameworks extra (scripts/setup.sh): fail, never skip
import openai  # noqa: E402

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
KEEP = 2
CLEARED = "[cleared]"
SCRIPT = [tool_call("read_file", {"path": f"f{k}.py"}) for k in range(N_CALLS)] + ["All read."]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]  # fmt: skip


def read_file(path: str) -> str:
    return " ".join(f"{path}:{j} value={j}" for j in range(30))


def clear_old_tool_results(messages: list, keep: int = KEEP) -> None:
    """The client's own edit, in place and sticky: tool results of all but the newest
    ``keep`` tool-calling turns become ``[cleared]``."""
    turns = [m for m in messages if _role(m) == "assistant" and _get(m, "tool_calls")]
    old = {tc.id for m in turns[: max(0, len(turns) - keep)] for tc in m.tool_calls}
    for m in messages:
        if _role(m) == "tool" and m["tool_call_id"] in old:
            m["content"] = CLEARED


def _role(m) -> str:
    return m["role"] if isinstance(m, dict) else m.role


def _get(m, key: str):
    return m.get(key) if isinstance(m, dict) else getattr(m, key, None)


def tool_loop(client: openai.OpenAI, model: str, base_url: str, *, edit=None) -> str:
    """A LiteLLM user's tool loop; returns the final answer."""
    messages: list = [{"role": "user", "content": "read four files"}]
    for _ in range(N_CALLS + 2):
        if edit is not None:
            edit(messages)
        resp = litellm.completion(
            model=f"openai/{model}", messages=messages, tools=TOOLS,
            api_base=base_url, api_key="none", client=client, max_retries=0,
        )  # fmt: skip
        msg = resp.choices[0].message
        messages.append(msg)
        if not msg.tool_calls:
            return msg.content
        for tc in msg.tool_calls:
            args = json.loads(tc.function.arguments)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": read_file(**args)})
    raise AssertionError("the loop did not end")


def tool_contents(body):
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


def test_client_stubbed_tool_results_are_spliced_by_the_server():
    with scripted_server(SCRIPT, client_edits="amortize") as (srv, engine):
        rec = Recorder()
        client = openai.OpenAI(
            base_url=srv.base_url, api_key="none", max_retries=0,
            http_client=httpx.Client(event_hooks={"request": [rec]}),
        )  # fmt: skip
        assert (
            tool_loop(client, engine.model_name, srv.base_url, edit=clear_old_tool_results)
            == "All read."
        )
        bodies = rec.bodies
        assert len(bodies) == N_CALLS + 1
        # the loop's edit as LiteLLM sent it: all but the newest KEEP tool results cleared
        for k, body in enumerate(bodies):
            assert tool_contents(body).count(CLEARED) == max(0, k - KEEP)
        # served exactly what LiteLLM sent (its message conversion included)
        assert engine.prompts == [rendered(engine.tokenizer, b) for b in bodies]
        # each newly cleared result spliced in place (one per call after the KEEP+1-th)
        s = stats(srv)
        assert s["splices"]["amortize"] == N_CALLS - KEEP, s


def test_transport_under_litellm_raw_response_path():
    with scripted_server(SCRIPT, client_edits="off") as (srv, engine):
        t = LeylineTransport([{"name": "stale-tool", "keep": KEEP}])
        rec = Recorder()
        client = openai.OpenAI(
            base_url=srv.base_url, api_key="none", max_retries=0,
            http_client=httpx.Client(transport=t, event_hooks={"request": [rec]}),
        )  # fmt: skip
        assert tool_loop(client, engine.model_name, srv.base_url) == "All read."
        assert len(rec.bodies) == N_CALLS + 1
        [session] = t.sessions
        assert session.stats.turns == N_CALLS + 1
        assert session.stats.resets == 0  # every reply observed through with_raw_response
        assert session.stats.forwarded_edits == N_CALLS - KEEP
        tok = engine.tokenizer
        assert engine.prompts == [
            rendered(tok, {**b, "messages": stale_tool_results(b["messages"])}) for b in rec.bodies
        ]
        s = stats(srv)
        assert s["splices"]["amortize"] == N_CALLS - KEEP, s
