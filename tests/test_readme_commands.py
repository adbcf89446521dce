"""The README's shell blocks and Python snippets, run as a user would paste them.

``COMMANDS`` is the exact list of the lines of every ```bash block of README.md (comments
dropped), and a test checks the two are the same, so they cannot drift. The run test pastes
them into bash (``set -euo pipefail``) in a scratch folder that holds what a clone has
(``.venv``, ``tests/data``), so ``leyline serve`` (the README's own command) really serves the
tiny model on 127.0.0.1; it fails on any non-zero exit and on any error JSON in the output.
The quick start's Python snippet then runs against that server (the model it names must be
the one served), and the policy snippet runs on a fixture trajectory.

Changes made for the run, and why (``RUN_AS``):
- port 30000 -> a free port (30000 may be taken on a shared machine);
- ``bench mechanism``: ``--concurrency 1`` instead of ``1,4,8,16`` (the same code path; four
  concurrencies take about a minute more on these CPUs);
- ``trajectories generate``: ``--n 1`` instead of ``--n 10`` (each takes ~40 s);
- ``make demo`` / ``make test`` / ``make check``: ``make -n`` (dry run: the targets and their
  recipes exist; ``make test`` would run this suite inside itself);
- ``vllm serve``: ``--help`` appended (a live vLLM server is what ``tests/vllm`` runs).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from leyline_agent.testing.server import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

MAKE = ["make demo", "make test", "make check"]
QUICK_START = [
    "source .venv/bin/activate",
    "leyline make-model --arch deepseek_v2 --size tiny --out .leyline/models/deepseek_v2-tiny",
    "leyline serve --model .leyline/models/deepseek_v2-tiny --port 30000 &",
    "until curl -s 127.0.0.1:30000/health > /dev/null; do sleep 1; done",
]
CLI = [
    "leyline policies list",
    "leyline policies apply --policy stale-tool --policy failed-call --keep 2 --indent 1 "
    "< tests/data/trajectory_10turn.json",
    "leyline trajectories generate --n 10 --seed 0 --min-turns 10 --max-turns 40 "
    "--out runs/trajectories.jsonl",
    "leyline bench mechanism --model .leyline/models/deepseek_v2-tiny --concurrency 1,4,8,16 "
    "--quick --out runs/mech-tiny",
    "leyline check correctness --model .leyline/models/deepseek_v2-tiny --quick "
    "--out runs/correctness-tiny",
    "leyline eval mini-nightmare --base-url http://127.0.0.1:30000/v1 --model deepseek_v2-tiny "
    "--tasks purr --arms baseline,stale-tool --max-steps 3 --max-tokens 16 --out runs/eval-tiny",
]
CURL_PREFIX = "curl -s 127.0.0.1:30000"
JSON_HDR = "-H 'Content-Type: application/json'"
OLD_TOOL = '"a.py b.py c.py d.py e.py f.py g.py h.py"'
CALL = (
    '{"role": "user", "content": "List the files."}, {"role": "assistant", "content": null, '
    '"tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "ls", '
    '"arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "call_1", "content": '
)
CURL = [
    "T=$(python3 -c 'print(list(range(100, 148)))')",
    f'{CURL_PREFIX}/v1/completions {JSON_HDR} -d "{{\\"model\\": \\"deepseek_v2-tiny\\", '
    '\\"prompt\\": $T, \\"max_tokens\\": 1}"',
    f'{CURL_PREFIX}/leyline/v1/directives {JSON_HDR} -d "{{\\"tokens\\": $T, \\"directives\\": '
    '[{\\"start\\": 8, \\"end\\": 24, \\"replacement\\": [17, 42], \\"mode\\": \\"amortize\\"}]}"',
    f"OLD='[{CALL}{OLD_TOOL}}}]'",
    f"NEW='[{CALL}\"[stale output of ls elided]\"}}]'",
    f'{CURL_PREFIX}/v1/chat/completions {JSON_HDR} -d "{{\\"model\\": \\"deepseek_v2-tiny\\", '
    '\\"messages\\": $OLD, \\"max_tokens\\": 1}"',
    f'{CURL_PREFIX}/leyline/v1/directives {JSON_HDR} -d "{{\\"old_messages\\": $OLD, '
    '\\"new_messages\\": $NEW}"',
    f"{CURL_PREFIX}/leyline/v1/stats",
    "curl -s -X POST 127.0.0.1:30000/leyline/v1/flush",
]
VLLM = [
    ".venv/bin/leyline make-model --arch llama --size tiny --out .leyline/models/llama-tiny",
    "VLLM_PLUGINS=leyline VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/vllm serve "
    ".leyline/models/llama-tiny --enable-prefix-caching --enable-prompt-tokens-details",
]
COMMANDS = MAKE + QUICK_START + CLI + CURL + VLLM

RUN_AS = {
    "--concurrency 1,4,8,16 --quick --out runs/mech-tiny": "--concurrency 1 --quick --out runs/mech-tiny",
    "trajectories generate --n 10 ": "trajectories generate --n 1 ",
}


def readme_commands() -> list[str]:
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else ""
            if line.strip():
                lines.append(line.strip())
    return lines


def test_the_list_is_the_readme() -> None:
    assert readme_commands() == COMMANDS
    for cmd in COMMANDS:
        assert "[...]" not in cmd and "..." not in cmd, cmd


def _run(script: str, cwd: Path, timeout: float) -> str:
    r = subprocess.run(
        [
            "bash",
            "-c",
            "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
    )
    assert r.returncode == 0, (
        f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    )
    return r.stdout


def _errors(stdout: str) -> list[str]:
    """Error JSON anywhere in the output (the curl lines print bodies back to back)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while (i := stdout.find("{", i)) >= 0:
        try:
            obj, end = dec.raw_decode(stdout, i)
        except ValueError:
            i += 1
            continue
        if isinstance(obj, dict) and "error" in obj:
            out.append(json.dumps(obj)[:300])
        i = end
    return out


def python_snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


# what the quick start's snippet leaves to the reader: a history and its tools
QUICK_START_PRELUDE = """
history = [{"role": "user", "content": "List the files."}]
tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
"""
QUICK_START_CHECK = """
print("QUICK_START_OK", resp.model, resp.usage.prompt_tokens)
"""


def test_the_commands_run_against_a_real_server(tmp_path: Path) -> None:
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "data").symlink_to(ROOT / "tests" / "data")
    port = str(free_port())
    quick_start = python_snippets()[0]
    assert "wrap_openai" in quick_start and "127.0.0.1:30000" in quick_start
    (tmp_path / "quick_start.py").write_text(
        QUICK_START_PRELUDE + quick_start.replace("30000", port) + QUICK_START_CHECK
    )
    script = []
    for cmd in [*QUICK_START, *CLI, *CURL, "python quick_start.py"]:
        for old, new in RUN_AS.items():
            cmd = cmd.replace(old, new)
        script.append(cmd.replace("30000", port))
    out = _run("\n".join(script), tmp_path, timeout=1500)
    assert _errors(out) == []
    assert '"outcome":"applied"' in out.replace(" ", "")  # both directive forms spliced
    assert out.replace(" ", "").count('"outcome":"applied"') == 2
    assert '"flushed_tokens"' in out
    assert "QUICK_START_OK deepseek_v2-tiny" in out  # the snippet names the served model
    summary = json.loads((tmp_path / "runs/eval-tiny/summary.json").read_text())
    assert set(summary["arms"]) == {"baseline", "stale-tool"}
    for name in ("runs/mech-tiny", "runs/correctness-tiny", "runs/trajectories.jsonl"):
        assert (tmp_path / name).exists(), name


def test_the_policy_snippet_edits_a_trajectory() -> None:
    from leyline_agent.policies import PolicyPipeline, Trajectory

    (snippet,) = [s for s in python_snippets() if "class DropBigLogs" in s]
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    messages = json.loads((ROOT / "tests/data/trajectory_10turn.json").read_text())
    call = {"id": "call_big", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    messages += [
        {"role": "user", "content": "Run it again."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_big", "content": "log line\n" * 2000},
    ]
    big = len(messages) - 1
    policy = scope["DropBigLogs"]()
    assert [e.index for e in policy.edits(Trajectory.parse(messages))] == [big]
    result = PolicyPipeline([policy]).apply(messages)
    assert result.messages[big]["content"] == "[log elided]"
    assert result.messages[:big] == messages[:big]


def test_make_targets_and_the_vllm_command_exist() -> None:
    for cmd in MAKE:
        _run(cmd.replace("make ", "make -n "), ROOT, timeout=60)
    assert (ROOT / ".venv-vllm/bin/vllm").exists(), "run scripts/setup_vllm.sh (make test does)"
    out = _run(" && ".join(VLLM) + " --help", ROOT, timeout=300)
    assert "usage: vllm serve" in out


def test_the_readme_links_to_files_that_exist() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [x for x in links if "://" not in x]
    assert local, "the README links to docs/"
    missing = [x for x in local if not (ROOT / x).exists()]
    assert not missing, missing
