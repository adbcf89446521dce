"""End to end: an agent loop wrapped with ``wrap_openai`` against a real ``leyline serve``.

Three arms replay the same 10-turn tool-using trajectory over HTTP with the real openai
client, each against its own server (same weights):

- ``full``: no policies (nothing edited: the cache-hit upper bound);
- ``radix``: stale-tool policy, directives off (what a plain prefix cache gives);
- ``splice``: stale-tool policy, directives forwarded (Leyline AMORTIZE).

The agent appends the trajectory's own assistant turns (not the random model's replies),
as debug-gym's agents do when they rebuild their history.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from leyline_agent.agent.wrappers import wrap_openai
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine
from leyline_agent.testing.server import serve_in_thread

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "trajectory_10turn.json"
SLACK = 8  # tokens: the server's cache also holds the model's own reply, which the
# agent replaces by its scripted turn; a few reply tokens may match by chance.


def _turn_prefixes(messages: list[dict]) -> list[list[dict]]:
    """The history the agent sends at each step: everything before each assistant turn."""
    return [messages[:i] for i, m in enumerate(messages) if m["role"] == "assistant"]


def _replay(arm: str, messages: list[dict]) -> tuple[list[tuple[int, int]], dict]:
    engine = Engine.from_pretrained(tiny_model_dir("deepseek_v2"), cache_budget_tokens=60_000)
    with serve_in_thread(engine) as srv:
        base = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        policies = [] if arm == "full" else [{"name": "stale-tool", "keep": 2}]
        client = wrap_openai(base, policies=policies, runtime="off" if arm == "radix" else "auto")
        usage = []
        for history in _turn_prefixes(messages):
            r = client.chat.completions.create(
                model=engine.model_name, messages=history, max_tokens=3, temperature=0.0
            )
            usage.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        stats = httpx.get(f"{srv.url}/leyline/v1/stats", timeout=30).json()
    return usage, stats


@pytest.fixture(scope="module")
def arms() -> dict[str, tuple[list[tuple[int, int]], dict]]:
    messages = json.loads(FIXTURE.read_text())
    return {arm: _replay(arm, messages) for arm in ("full", "radix", "splice")}


def test_splice_keeps_everything_but_the_edited_tokens_cached(arms):
    full, _ = arms["full"]
    splice, stats = arms["splice"]
    assert stats["splices"]["amortize"] > 0
    for k in range(1, len(full)):
        removed = full[k][0] - splice[k][0]  # tokens the edits took out of this prompt
        assert removed >= 0
        # Every edit lies in the previous prompt, so what the full arm reuses, the splice
        # arm reuses too, less exactly the tokens the edits removed.
        assert abs(splice[k][1] - (full[k][1] - removed)) <= SLACK, (k, full[k], splice[k])


def test_radix_reprefills_from_the_first_edit_and_splice_does_not(arms):
    radix, radix_stats = arms["radix"]
    splice, _ = arms["splice"]
    assert radix_stats["splices"] == {"amortize": 0, "forget": 0}
    assert [p for p, _ in radix] == [p for p, _ in splice]  # the same edited prompts
    edited_turns = [k for k in range(1, len(radix)) if radix[k][1] + SLACK < splice[k][1]]
    assert len(edited_turns) >= 5  # stale tool outputs are stubbed on most later turns
    hit = {a: sum(c for _, c in arms[a][0]) / sum(p for p, _ in arms[a][0]) for a in arms}
    assert hit["splice"] > hit["radix"] + 0.10, hit
