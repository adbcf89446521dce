"""Library use logs nothing unless the application configures ``logging`` (or the CLI
configures structlog); ``py.typed`` ships so type checkers read the package's hints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import leyline_agent

SCRIPT = """
import json, logging, sys
if sys.argv[1] == "debug":
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s %(message)s")
from leyline_agent.agent.session import ContextSession
from leyline_agent.policies import load_policy
msgs = json.load(open(sys.argv[2]))
session = ContextSession([load_policy({"name": "stale-tool", "keep": 1})])
for i in range(2, len(msgs)):
    session.plan(msgs[:i])
print("done")
"""
FIXTURE = Path(__file__).resolve().parent / "data" / "trajectory_10turn.json"


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(FIXTURE)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip


def test_library_use_is_silent_by_default():
    out = _run("quiet")
    assert (out.stdout, out.stderr) == ("done\n", "")


def test_the_application_turns_logging_on_with_the_standard_library():
    out = _run("debug")
    assert out.stdout == "done\n"
    assert "leyline_agent.agent.session session.plan" in out.stderr


def test_py_typed_ships():
    assert (Path(leyline_agent.__file__).parent / "py.typed").is_file()
