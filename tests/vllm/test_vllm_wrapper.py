"""``wrap_openai`` with the stale-tool policy against ``vllm serve`` + Leyline: its edits ride
in the chat requests (no directive request: ``front.chat_proxy``) and become AMORTIZE splices
(``/leyline/v1/stats``), and the agent's next prompts are served from its own spliced
blocks; a server with prefix caching off is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai

from leyline_agent import wrap_openai
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.testing.server import serve_vllm

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "trajectory_10turn.json"


def _chat(client, model, messages, **kw):
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, temperature=0, **kw
    )
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def test_wrap_openai_issues_splices_and_the_session_reuses_them(llama):
    from leyline_agent.trajectory import apply_edits

    live = llama
    history = json.loads(FIXTURE.read_text())
    turns = [history[:i] for i, m in enumerate(history) if m["role"] == "assistant"]
    plain = openai.OpenAI(base_url=live.srv.base_url, api_key="-", max_retries=0)
    client = wrap_openai(plain, policies=[{"name": "stale-tool", "keep": 2}], session_id="agent-w")
    before = live.stats()
    assert {"body_edits", "client_edits"} <= set(before["features"])  # as leyline serve
    for messages in turns:
        _chat(client, live.srv.model, messages)
    after = live.stats()
    session = client.leyline.session("agent-w")
    stats = session.stats
    assert stats.runtime_calls == 0 and stats.runtime_failures == 0, stats  # no directive request
    assert stats.body_edits >= 3, stats
    assert after["fallbacks"] == before["fallbacks"]
    assert after["splices"]["amortize"] - before["splices"]["amortize"] >= 3
    assert after["directive_errors"] == before["directive_errors"]
    assert after["rotated_tokens"] > before["rotated_tokens"]

    last = apply_edits(turns[-1], session.sticky_edits)
    prompt, own = _chat(plain, live.srv.model, last, extra_headers={"X-Leyline-Session": "agent-w"})
    _, other = _chat(plain, live.srv.model, last, extra_headers={"X-Leyline-Session": "agent-x"})
    assert own >= prompt - 2 * live.block  # its own blocks: all but the last partial ones
    assert other < own // 2, (prompt, own, other)  # another session: the exact prefix only


def test_prefix_caching_off_is_refused_by_name():
    with serve_vllm(
        tiny_model_dir("llama"), block_size=32, extra_args=["--no-enable-prefix-caching"]
    ) as srv:
        r = httpx.post(
            srv.url + "/leyline/v1/directives",
            json={"tokens": [5, 6, 7], "directives": [{"start": 0, "end": 1, "replacement": []}]},
            timeout=60,
        )
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["leyline_type"] == "RuntimeUnavailableError" and err["field"] == "enable_prefix_caching"
