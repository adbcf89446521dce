"""Start a real Leyline server on a free loopback port, for tests and experiments.

``serve_in_thread(engine_or_app)``: uvicorn in a background thread of this process, on a
socket bound before the server starts (no port race); returns once it answers.
``serve_in_process(model_dir, *args)``: ``python -m leyline_agent.cli serve`` in a child
process (the real command line); waits for ``/health``. Both are context managers whose
``stop()`` shuts the server down cleanly (and the app closes its worker).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

__all__ = ["ServerProcess", "ThreadServer", "free_port", "serve_in_process", "serve_in_thread"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_ready(base_url: str, timeout: float, alive: Any = None) -> None:
    """Poll ``/health`` until it answers 200 (``alive()`` false -> give up early)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"the server at {base_url} exited before it was ready")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"the server at {base_url} was not ready after {timeout}s ({last})")


class _Served:
    """A server on ``host:port``: its URLs, and ``stop`` on leaving a ``with`` block."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What the OpenAI client takes: ``http://host:port/v1``."""
        return f"{self.url}/v1"

    def stop(self, timeout: float = 30.0) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class ThreadServer(_Served):
    host: str
    port: int
    _server: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)


def serve_in_thread(
    engine_or_app: Any, *, host: str = "127.0.0.1", timeout: float = 30.0, **app_kwargs: Any
) -> ThreadServer:
    """Serve an ``Engine`` (or a ready FastAPI app) on a free port of ``host``."""
    import uvicorn
    from fastapi import FastAPI

    from leyline_agent.server.app import create_app

    app = (
        engine_or_app
        if isinstance(engine_or_app, FastAPI)
        else create_app(engine_or_app, **app_kwargs)
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = int(sock.getsockname()[1])
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"leyline-server-{port}", daemon=True
    )
    thread.start()
    handle = ThreadServer(host=host, port=port, _server=server, _thread=thread)
    try:
        wait_ready(handle.url, timeout, alive=thread.is_alive)
    except BaseException:
        handle.stop()
        raise
    return handle


@dataclass
class ServerProcess(_Served):
    host: str
    port: int
    process: subprocess.Popen = field(repr=False)
    log_path: Path | None = None

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # uvicorn shuts down cleanly on SIGTERM
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)


def serve_in_process(
    model_dir: str | Path,
    *args: str,
    port: int | None = None,
    connect_host: str = "127.0.0.1",
    timeout: float = 120.0,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
    python: str | None = None,
    ready: bool = True,
) -> ServerProcess:
    """Run ``leyline serve --model model_dir --port P *args`` in a child process.

    ``args`` are passed as given (no ``--host`` is added: the command's default applies).
    ``connect_host`` is where this helper looks for it. ``python``: the interpreter (this
    one by default). ``ready=False``: return at once, the caller waits (``wait_ready``), so
    that the start can overlap another server's.
    """
    port = free_port(connect_host) if port is None else port
    cmd = [
        python or sys.executable,
        "-m",
        "leyline_agent.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        *args,
    ]
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    finally:
        if log_path:
            out.close()  # type: ignore[union-attr]
    handle = ServerProcess(
        host=connect_host, port=port, process=proc, log_path=Path(log_path) if log_path else None
    )
    if not ready:
        return handle
    try:
        wait_ready(handle.url, timeout, alive=lambda: proc.poll() is None)
    except BaseException:
        handle.stop()
        raise
    return handle
