"""The real Codex CLI (``@openai/codex``, installed by scripts/setup.sh) on its default
settings against a real ``leyline serve`` app on loopback.

Codex's config holds only the provider (``base_url``, ``env_key``, ``wire_api =
"responses"``); everything else is Codex's default request: ``reasoning.summary``,
``include: ["reasoning.encrypted_content"]``, ``store: false``, ``prompt_cache_key``, a
``namespace`` tool and a hosted ``web_search`` tool. The model is the tiny engine answering a
script (``ScriptedEngine``: a random-weight model writes no tool calls) that runs two shell
commands through Codex's own ``exec_command`` tool, then answers. Checks: Codex exits 0, every
request the server got was a 200, at least 3 model turns, the command's output came back into
the prompt, and the hints Codex sent are counted as ignored in ``/leyline/v1/stats``.
The same against ``vllm serve`` + the plugin: ``tests/vllm/test_vllm_codex.py``.
"""

from __future__ import annotations

import pytest

from leyline_agent.testing.codex import FINAL, PROBE, SCRIPT, run_codex
from leyline_agent.testing.frameworks import scripted_server, stats

pytestmark = pytest.mark.slow


def test_codex_exec_on_its_defaults(tmp_path):
    answers: list[tuple[str, int]] = []
    with scripted_server(SCRIPT, statuses=answers) as (srv, engine):
        run = run_codex(srv.base_url, engine.model_name, tmp_path)
        counts = stats(srv)
        prompts = [engine.tokenizer.decode(p) for p in engine.prompts]
    assert run.returncode == 0, run.stderr[-3000:]
    turns = [s for path, s in answers if path == "/v1/responses"]
    assert len(turns) >= 3, answers
    assert all(s == 200 for _, s in answers), answers
    assert FINAL in run.stdout
    assert any(PROBE in p.split("echo " + PROBE, 1)[-1] for p in prompts[1:])  # ran, output back
    ignored = counts["ignored_fields"]
    for name in ("reasoning.summary", "include", "tools"):  # tools: the hosted web_search
        assert ignored.get(name, 0) >= len(turns), ignored
    assert counts["cached_tokens"] > 0  # the turns reused the cached prefix
