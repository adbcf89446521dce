"""smolagents (``ToolCallingAgent`` + ``OpenAIServerModel``) against a real ``leyline serve`` on
loopback, with Leyline's policies in a ``LeylineTransport`` given as ``client_kwargs={"http_client": ...}``.

The model is the tiny engine answering a script (``ScriptedEngine``: a random-weight model
cannot drive a tool loop); the loop, the parsing of the server's OpenAI ``tool_calls``, the
tool execution, the ``final_answer`` tool that ends the run and the memory are smolagents'.
smolagents sends no ``tool`` role: a call goes back as assistant text ("Calling tools: ...")
and its result as a user message opening with ``Observation:``, so the stale-tool rule is
told to read those (``observation_prefix``). Checks: the session's counters (no reset, one
forwarded edit per newly stale observation), splices in ``/leyline/v1/stats``, and the
engine's prompts are the tokenizer's template on exactly what smolagents sent (recorded by
an httpx hook, which runs before the transport) with the stale rule applied here, then the
``<tool_call>`` tag the server opens the answer with (smolagents sends ``tool_choice:
"required"``).

smolagents' own edit (a ``step_callbacks`` hook clearing old observations) on a plain
client is served as sent and spliced by the server (smolagents echoes the reply's call ids
in assistant text and sends observations as user messages; the server believes the edit
from those ids); under ``--client-edits off`` nothing is spliced.
"""

from __future__ import annotations

import httpx
import pytest
import smolagents  # noqa: E402, F401  -- the frameworks extra (scripts/setup.sh): fail, never skip
from smolagents import ActionStep, OpenAIServerModel, ToolCallingAgent, tool  # noqa: E402

from leyline_agent.agent.transport import LeylineTransport  # noqa: E402
from leyline_agent.testing.frameworks import Recorder, rendered, scripted_server, stats  # noqa: E402
from leyline_agent.testing.scripted_engine import tool_call  # noqa: E402

pytestmark = pytest.mark.slow

N_CALLS = 4
KEEP = 2
PREFIX = "Observation:"
STUB = f"{PREFIX} [stale output of observation elided]"
SCRIPT = [tool_call("read_file", {"path": f"f{k}.py"}) for k in range(N_CALLS)]
SCRIPT.append(tool_call("final_answer", {"answer": "All read."}))


@tool
def read_file(path: str) -> str:
    """Read a file.

    Args:
        path: the file to read.
    """
    return " ".join(f"{path}:{j} value={j}" for j in range(30))


def text(m) -> str:
    c = m["content"]
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c)


def observations(messages) -> list[int]:
    """smolagents' tool results: user messages opening with ``Observation:`` right after an
    assistant message."""
    return [
        i for i, m in enumerate(messages)
        if i and m["role"] == "user" and messages[i - 1]["role"] == "assistant"
        and text(m).lstrip().startswith(PREFIX)
    ]  # fmt: skip


def stale(messages, keep=KEEP):
    """The stale-tool rule with ``observation_prefix``, computed here: all but the newest
    ``keep`` observations replaced by the stub (behind the prefix)."""
    obs = observations(messages)
    old = set(obs[: max(0, len(obs) - keep)])
    return [{**m, "content": STUB} if i in old else m for i, m in enumerate(messages)]


def served(tok, body):
    """The prompt for ``body``: the template's, then (smolagents sends ``tool_choice:
    "required"``) the tool-call tag the server opens the answer with (README, tool_choice)."""
    assert body["tool_choice"] == "required"
    return rendered(tok, body) + tok.encode("<tool_call>\n", add_special_tokens=False)


def test_transport_in_client_kwargs_edits_smolagents_observations():
    with scripted_server(SCRIPT, client_edits="off") as (srv, engine):
        t = LeylineTransport([{"name": "stale-tool", "keep": KEEP, "observation_prefix": PREFIX}])
        rec = Recorder()
        model = OpenAIServerModel(
            model_id=engine.model_name, api_base=srv.base_url, api_key="none",
            client_kwargs={"http_client": httpx.Client(transport=t, event_hooks={"request": [rec]}),
                           "max_retries": 0},
        )  # fmt: skip
        agent = ToolCallingAgent(
            tools=[read_file], model=model, max_steps=N_CALLS + 2, verbosity_level=0
        )
        assert agent.run("read four files") == "All read."
        bodies = rec.bodies
        assert len(bodies) == N_CALLS + 1
        # smolagents' own history: one more observation per turn, the results in full
        for k, body in enumerate(bodies):
            obs = observations(body["messages"])
            assert len(obs) == k
            assert all("value=29" in text(body["messages"][i]) for i in obs)
        [session] = t.sessions
        assert session.stats.resets == 0
        assert session.stats.forwarded_edits == N_CALLS - KEEP
        tok = engine.tokenizer
        assert engine.prompts == [
            served(tok, {**b, "messages": stale(b["messages"])}) for b in bodies
        ]
        s = stats(srv)
        assert s["splices"]["amortize"] == N_CALLS - KEEP, s


CLEARED = "[cleared]"


def clear_old_observations(step, agent):
    """smolagents' own extension point (a step callback, as its docs use to drop old
    screenshots): the observations of all but the newest ``KEEP`` steps become ``[cleared]``.
    It runs when a step ends, before smolagents adds the step to its memory."""
    done = [*agent.memory.steps, step] if step not in agent.memory.steps else agent.memory.steps
    steps = [s for s in done if isinstance(s, ActionStep) and s.observations is not None]
    for old in steps[: max(0, len(steps) - KEEP)]:
        old.observations = CLEARED


@pytest.mark.parametrize("client_edits", ["amortize", "off"])
def test_step_callback_edits_are_spliced_by_the_server(client_edits):
    with scripted_server(SCRIPT, client_edits=client_edits) as (srv, engine):
        rec = Recorder()
        model = OpenAIServerModel(
            model_id=engine.model_name, api_base=srv.base_url, api_key="none",
            client_kwargs={"http_client": httpx.Client(event_hooks={"request": [rec]}), "max_retries": 0},
        )  # fmt: skip
        agent = ToolCallingAgent(
            tools=[read_file], model=model, max_steps=N_CALLS + 2, verbosity_level=0,
            step_callbacks=[clear_old_observations],
        )  # fmt: skip
        assert agent.run("read four files") == "All read."
        bodies = rec.bodies
        assert len(bodies) == N_CALLS + 1
        # smolagents' edit, as sent: all but the newest KEEP observations cleared
        for k, body in enumerate(bodies):
            msgs = body["messages"]
            seen = [text(msgs[i]) for i in observations(msgs)]
            assert seen.count(f"{PREFIX}\n{CLEARED}") == max(0, k - KEEP)
        # served exactly what smolagents sent
        assert engine.prompts == [served(engine.tokenizer, b) for b in bodies]
        # each newly cleared observation spliced in place (amortize), none under off
        s = stats(srv)
        assert s["splices"]["amortize"] == (N_CALLS - KEEP if client_edits == "amortize" else 0), s
