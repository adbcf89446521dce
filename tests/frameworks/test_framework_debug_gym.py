"""debug-gym (its ``froggy`` agent, ``MiniNightmareEnv`` on a ``LocalTerminal``) against a real
``leyline serve`` on loopback, its LLM ``LeylineHuggingFaceLLM``.

The model is the tiny engine answering a script (``ScriptedEngine``: a random-weight model
cannot drive a tool loop): read the ``purr`` task's code and tests, list the folder, apply
the known fix, run the tests. The agent, its prompts, the history it rebuilds at every step,
its tools (run for real on a copy of the task, provisioned offline from the wheel) and its
pytest run that ends the episode solved are debug-gym's. Two recipes:
- ``http_client=httpx.Client(transport=LeylineTransport([stale-tool]))``: the transport
  edits below the SDK; an httpx hook (run before the transport) records what debug-gym sent;
- ``policies=[stale-tool]`` (``wrap_openai``, what ``leyline eval mini-nightmare`` uses):
  the hook records the bodies after Leyline's edits.
Each checks the session's counters, splices in ``/leyline/v1/stats``, the stale-tool rule on
the tool results (computed here) and that the engine's prompts are the tokenizer's template
on exactly what was sent.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # debug-gym imports litellm

import debug_gym  # noqa: E402, F401  -- set up by scripts/setup.sh; fail, never skip
from debug_gym.agents.base_agent import create_agent  # noqa: E402
from debug_gym.logger import DebugGymLogger  # noqa: E402

from leyline_agent.agent.transport import LeylineTransport  # noqa: E402
from leyline_agent.engine.checkpoints.store import tiny_model_dir  # noqa: E402
from leyline_agent.experiments.eval.eval_config import load_eval_config  # noqa: E402
from leyline_agent.experiments.eval.nightmare import load_tasks, make_env, quiet_debug_gym  # noqa: E402
from leyline_agent.integrations.debug_gym import LeylineHuggingFaceLLM, make_llm_config  # noqa: E402
from leyline_agent.testing.frameworks import (  # noqa: E402
    ARCH,
    Recorder,
    rendered,
    scripted_server,
    stale_tool_results,
    stats,
)
from leyline_agent.testing.purr import PURR_FIX  # noqa: E402
from leyline_agent.testing.scripted_engine import tool_call  # noqa: E402

pytestmark = pytest.mark.slow

KEEP = 2
SCRIPT = [
    tool_call("view", {"path": "purr_code.py"}),
    tool_call("view", {"path": "purr_test.py"}),
    tool_call("bash", {"command": "ls"}),
    tool_call("edit", {"path": "purr_code.py", "start": 27, "end": 32, "new_code": PURR_FIX}),
    tool_call("eval", {}),
]
N_CALLS = len(SCRIPT)


def tool_results(body) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


def episode(tmp_path: Path, srv, engine, **llm_kw) -> tuple[object, object]:
    """One froggy episode on ``purr``; returns (env, llm)."""
    quiet_debug_gym()
    config = load_eval_config()
    task = load_tasks(tmp_path / "data", ["purr"])["purr"]
    logger = DebugGymLogger("purr", log_dir=str(tmp_path / "log"), level=logging.ERROR, mode="w")
    env = make_env(task, config, logger)
    tok_dir = tiny_model_dir(ARCH)
    llm = LeylineHuggingFaceLLM(
        engine.model_name, make_llm_config(engine.model_name, srv.base_url, tok_dir, context_limit_k=8),
        logger=logger, **llm_kw,
    )  # fmt: skip
    agent = create_agent({**config.agent, "max_steps": N_CALLS + 2}, llm=llm, logger=logger)
    try:
        agent.run(env)
    finally:
        env.close()
        logger.close()
    return env, llm


def test_transport_in_http_client_edits_debug_gym_history(tmp_path: Path):
    with scripted_server(SCRIPT, client_edits="off") as (srv, engine):
        t = LeylineTransport([{"name": "stale-tool", "keep": KEEP}])
        rec = Recorder()
        env, _ = episode(
            tmp_path,
            srv,
            engine,
            http_client=httpx.Client(transport=t, event_hooks={"request": [rec]}),
        )
        assert env.resolved  # debug-gym's own pytest run on the fixed code
        bodies = rec.bodies
        assert len(bodies) == N_CALLS
        # debug-gym's own history, unedited, one more tool result per turn
        assert [len(tool_results(b)) for b in bodies] == list(range(N_CALLS))
        assert "class Cat" in tool_results(bodies[-1])[0]
        [session] = t.sessions
        assert session.stats.resets == 0
        assert session.stats.forwarded_edits == N_CALLS - 1 - KEEP
        tok = engine.tokenizer
        assert engine.prompts == [
            rendered(tok, {**b, "messages": stale_tool_results(b["messages"])}) for b in bodies
        ]
        s = stats(srv)
        # the policy's edits, each spliced once, plus the template drifts the server found
        # itself (counted apart: drift_splices), never fewer
        assert s["splices"]["amortize"] == N_CALLS - 1 - KEEP + s["drift_splices"], s
        assert s["drift_splices"] <= N_CALLS - 1 and not s["drift_unspliced"], s


def test_policies_of_the_integration_are_spliced(tmp_path: Path):
    with scripted_server(SCRIPT, client_edits="off") as (srv, engine):
        rec = Recorder()
        env, llm = episode(
            tmp_path, srv, engine, policies=[{"name": "stale-tool", "keep": KEEP}],
            session_id="purr-1", http_client=httpx.Client(event_hooks={"request": [rec]}),
        )  # fmt: skip
        assert env.resolved
        bodies = rec.bodies  # after Leyline's edits (wrap_openai edits above the SDK)
        assert len(bodies) == N_CALLS
        for k, body in enumerate(bodies):
            results = tool_results(body)
            assert len(results) == k
            # the older results stubbed (naming their tools), the newest KEEP intact
            assert sum(r.startswith("[stale output of ") for r in results) == max(0, k - KEEP)
            assert stale_tool_results(body["messages"]) == body["messages"]
        assert "class Cat" in tool_results(bodies[2])[0]
        [session] = llm.client.leyline.sessions.values()
        assert session.session_id == "purr-1" and session.stats.resets == 0
        assert session.stats.forwarded_edits == N_CALLS - 1 - KEEP
        assert engine.prompts == [rendered(engine.tokenizer, b) for b in bodies]
        s = stats(srv)
        # the policy's edits, each spliced once, plus the template drifts the server found
        # itself (counted apart: drift_splices), never fewer
        assert s["splices"]["amortize"] == N_CALLS - 1 - KEEP + s["drift_splices"], s
        assert s["drift_splices"] <= N_CALLS - 1 and not s["drift_unspliced"], s
