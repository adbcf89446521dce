"""``leyline serve`` as a user runs it: a busy port is one clean error line (before the model
loads), and "serving at" is printed only once the port is bound (a connect then succeeds)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.testing.server import free_port

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "leyline_agent.cli"]


def test_busy_port_is_one_clean_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = subprocess.run(
            [*CLI, "serve", "--model", str(tiny_model_dir("llama")), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [
        f"leyline: error: --port: 127.0.0.1:{port} is already in use (another server on it?); "
        "stop it or pick another --port"
    ], r.stderr
    assert "serving" not in r.stdout + r.stderr


def test_serving_is_printed_after_the_bind() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "serve", "--model", str(tiny_model_dir("llama")), "--port", str(port)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "serving" in line:
                break
        assert f"at http://127.0.0.1:{port} " in seen[-1], seen
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # bound and listening as soon as it says so
    finally:
        proc.terminate()
        proc.wait(30)
