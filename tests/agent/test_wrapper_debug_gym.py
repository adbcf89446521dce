"""debug-gym's LLM through Leyline names its session on every request (real loopback HTTP).

``LeylineHuggingFaceLLM.generate`` is the call debug-gym's agents make; it goes through
``wrap_openai``, so each chat request and each directive request carries the session
(``X-Leyline-Session``, and the directive's ``session`` field) and the endpoint's API key.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import debug_gym  # noqa: E402, F401  -- set up by scripts/setup.sh; fail, never skip

from leyline_agent.integrations.debug_gym import (  # noqa: E402
    LeylineHuggingFaceLLM,
    make_llm_config,
)
from leyline_agent.testing.scripted import ReplayModel  # noqa: E402
from leyline_agent.testing.stub_server import StubServer  # noqa: E402

# slow: importing debug-gym's LLM (its gym, swesmith, datasets, litellm) takes about 13 s of CPU
pytestmark = pytest.mark.slow

VIEW = {"content": "Let me look.", "tool": "view", "arguments": {"path": "a.py"}}


def episode(llm: LeylineHuggingFaceLLM, turns: int) -> None:
    """The agent's side of a few steps: its history, each tool result appended."""
    messages = [{"role": "system", "content": "Fix it."}, {"role": "user", "content": "go"}]
    for _ in range(turns):
        reply = llm.convert_response_to_message(llm.generate(messages, None))
        messages.append(reply)
        for tc in reply.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": "line\n" * 40})


@pytest.mark.parametrize("session_id", ["dg-episode-1", None])
def test_every_request_of_the_wrapped_llm_names_the_session(session_id):
    with StubServer(ReplayModel([VIEW]), directive_answer="fallback") as server:
        config = make_llm_config(
            server.model, server.url, "unused-tokenizer", context_limit_k=8, api_key="key-1"
        )
        llm = LeylineHuggingFaceLLM(
            server.model,
            config,
            policies=[{"name": "stale-tool", "keep": 1}],
            session_id=session_id,
        )
        episode(llm, 4)
        expected = session_id or llm.client.leyline.default_session
        assert [h.get("x-leyline-session") for h in server.chat_headers()] == [expected] * 4
        # the results of tool turns 0 and 1 went stale: their edits ride in those turns' chat
        # bodies (the stub, like leyline serve, lists body_edits), no directive request
        edited = [b for b in server.chat_bodies() if (b.get("leyline") or {}).get("edits")]
        assert len(edited) == 2 and server.directive_bodies() == []
        assert all(h.get("authorization") == "Bearer key-1" for h in server.chat_headers())


def test_the_baseline_llm_is_not_wrapped():
    with StubServer(ReplayModel([VIEW]), directive_answer="fallback") as server:
        config = make_llm_config(server.model, server.url, "unused-tokenizer", context_limit_k=8)
        episode(LeylineHuggingFaceLLM(server.model, config), 2)
        assert [h.get("x-leyline-session") for h in server.chat_headers()] == [None, None]
        assert server.directive_bodies() == []
