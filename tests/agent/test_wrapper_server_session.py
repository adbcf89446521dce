"""The wrapper against a real ``leyline serve`` with ``--api-key``: the session header and
the key are what let an agent reuse its own spliced KV rows.

Spliced rows belong to the session that made the splice (``leyline_agent.namespaces``): a
request reuses them only if it names that session. The wrapped client names its session
on every call, so after each splice its next prompt is served from the spliced rows (and
its new turn is cached in its own namespace); the same prompt under another session finds
only the exact rows before the first edit, and then computes the rest exactly, rows every
session of the tenant shares. Expected counts come from the prompt itself (its length less
the last token, which the engine always recomputes), not from the wrapper.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from leyline_agent.agent.http_runtime import AuthenticationError, HTTPRuntime
from leyline_agent.agent.wrappers import wrap_openai
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine
from leyline_agent.testing.server import serve_in_thread
from leyline_agent.trajectory import apply_edits
from leyline_agent.wire import DirectivesRequest

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "trajectory_10turn.json"
KEY = "tenant-key-1"


@pytest.fixture(scope="module")
def keyed():
    engine = Engine.from_pretrained(tiny_model_dir("deepseek_v2"), cache_budget_tokens=60_000)
    with serve_in_thread(engine, api_keys=[(KEY, None)], allowed_hosts=[]) as srv:
        yield srv, engine.model_name


def _turn_prefixes(messages: list[dict]) -> list[list[dict]]:
    return [messages[:i] for i, m in enumerate(messages) if m["role"] == "assistant"]


def _cached(client: openai.OpenAI, name: str, messages: list[dict], **kw) -> tuple[int, int]:
    r = client.chat.completions.create(
        model=name, messages=messages, max_tokens=1, temperature=0.0, **kw
    )
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def test_the_wrapped_agent_reuses_its_own_spliced_rows_and_nobody_else_does(keyed):
    srv, name = keyed
    plain = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    client = wrap_openai(plain, policies=[{"name": "stale-tool", "keep": 2}], session_id="agent-a")
    history = _turn_prefixes(json.loads(FIXTURE.read_text()))
    for messages in history:
        _cached(client, name, messages)
    session = client.leyline.session("agent-a")
    assert session.stats.runtime_failures == 0
    assert session.stats.runtime_calls == 0  # no directive requests: the edits rode along
    assert session.stats.body_edits >= 3
    stats = httpx.get(
        f"{srv.url}/leyline/v1/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    ).json()
    assert stats["splices"]["amortize"] >= 3 and stats["directive_errors"] == 0

    # The last prompt the wrapper sent (the agent's history with every sticky edit), again:
    last = apply_edits(history[-1], session.sticky_edits)
    prompt, own = _cached(plain, name, last, extra_headers={"X-Leyline-Session": "agent-a"})
    assert own == prompt - 1  # the session's own spliced rows: all of it
    _, other = _cached(plain, name, last, extra_headers={"X-Leyline-Session": "agent-b"})
    assert min(e.index for e in session.sticky_edits) == 3  # the first stale tool result
    # another session finds only the exact rows before the first edited message ...
    assert other < prompt // 4, (prompt, other)
    # ... and computes the rest exactly: those rows are shared by token identity
    _, anonymous = _cached(plain, name, last)
    assert anonymous == prompt - 1


def test_a_wrong_key_is_an_authentication_error_on_the_directives_route(keyed):
    srv, _ = keyed
    req = DirectivesRequest(tokens=[5, 6, 7], directives=[{"start": 0, "end": 1}], session="x")
    for key in (None, "wrong"):
        rt = HTTPRuntime(srv.url, api_key=key, retries=3, backoff_s=0.01)
        with pytest.raises(AuthenticationError, match="HTTP 401"):
            rt.apply_directives(req)
        with pytest.raises(AuthenticationError):
            rt.has_leyline()
