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
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from leyline_agent.testing.frameworks import scripted_server, stats
from leyline_agent.testing.scripted_engine import tool_call

ROOT = Path(__file__).resolve().parents[1]
CODEX = ROOT / ".clients" / "codex" / "node_modules" / ".bin" / "codex"  # scripts/setup.sh
PROBE = "leyline-codex-probe"
SCRIPT = [
    tool_call("exec_command", {"cmd": f"echo {PROBE}"}),
    tool_call("exec_command", {"cmd": "echo second"}),
    "All done.",
]


def test_codex_exec_on_its_defaults(tmp_path):
    assert CODEX.exists(), f"{CODEX} missing: run scripts/setup.sh (npm install of @openai/codex)"
    answers: list[tuple[str, int]] = []
    with scripted_server(SCRIPT, statuses=answers) as (srv, engine):
        home = tmp_path / "codex-home"
        home.mkdir()
        (home / "config.toml").write_text(
            'model_provider = "leyline"\n'
            "[model_providers.leyline]\n"
            'name = "leyline"\n'
            f'base_url = "{srv.base_url}"\n'
            'env_key = "LEYLINE_API_KEY"\n'
            'wire_api = "responses"\n'
        )
        env = {**os.environ, "CODEX_HOME": str(home), "LEYLINE_API_KEY": "none"}
        run = subprocess.run(
            [str(CODEX), "exec", "--skip-git-repo-check", "-s", "read-only",
             "-m", engine.model_name, "Say what echo prints."],
            env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        counts = stats(srv)
        prompts = [engine.tokenizer.decode(p) for p in engine.prompts]
    assert run.returncode == 0, run.stderr[-3000:]
    turns = [s for path, s in answers if path == "/v1/responses"]
    assert len(turns) >= 3, answers
    assert all(s == 200 for _, s in answers), answers
    assert "All done." in run.stdout
    assert any(PROBE in p.split("echo " + PROBE, 1)[-1] for p in prompts[1:])  # ran, output back
    ignored = counts["ignored_fields"]
    for name in ("reasoning.summary", "include", "tools"):  # tools: the hosted web_search
        assert ignored.get(name, 0) >= len(turns), ignored
    assert counts["cached_tokens"] > 0  # the turns reused the cached prefix
