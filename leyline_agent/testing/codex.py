"""The real Codex CLI (``@openai/codex``, installed by scripts/setup.sh into ``.clients/codex``)
run as ``codex exec`` against a server, for the client tests of both servers.

``SCRIPT``: what the scripted model answers (two shell commands through Codex's own
``exec_command`` tool, then a final answer), for ``ScriptedEngine`` (``leyline serve``) and
``vllm_script.ScriptedLogits`` (``vllm serve``) alike. ``run_codex``: Codex on its default
settings plus only the provider config (``base_url``, ``env_key``, ``wire_api =
"responses"``), in a fresh ``CODEX_HOME``; returns the finished process.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from leyline_agent.testing.scripted_engine import tool_call

__all__ = ["CODEX", "PROBE", "SCRIPT", "run_codex"]

CODEX = (
    Path(__file__).resolve().parents[2] / ".clients" / "codex" / "node_modules" / ".bin" / "codex"
)
PROBE = "leyline-codex-probe"
FINAL = "All done."
SCRIPT = [
    tool_call("exec_command", {"cmd": f"echo {PROBE}"}),
    tool_call("exec_command", {"cmd": "echo second"}),
    FINAL,
]


def run_codex(
    base_url: str, model: str, workdir: Path, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``codex exec`` of one task in ``workdir`` against ``base_url`` (``.../v1``)."""
    if not CODEX.exists():
        raise FileNotFoundError(
            f"{CODEX} missing: run scripts/setup.sh (npm install of @openai/codex)"
        )
    home = workdir / "codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        'model_provider = "leyline"\n'
        "[model_providers.leyline]\n"
        'name = "leyline"\n'
        f'base_url = "{base_url}"\n'
        'env_key = "LEYLINE_API_KEY"\n'
        'wire_api = "responses"\n'
    )
    env = {**os.environ, "CODEX_HOME": str(home), "LEYLINE_API_KEY": "none"}
    return subprocess.run(
        [str(CODEX), "exec", "--skip-git-repo-check", "-s", "read-only", "-m", model,
         "Say what echo prints."],
        env=env, cwd=workdir, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
