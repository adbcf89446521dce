"""Start a real Leyline server on a free loopback port, for tests.

``serve_in_thread(engine_or_app)``: uvicorn in a background thread of this process, on a
socket bound before the server starts (no port race); returns once it answers; ``stop()``
shuts it down cleanly (and the app closes its worker). The child-process servers
(``serve_in_process``: ``leyline serve``; ``serve_vllm``) are ``leyline_agent.launch``'s,
the one launcher tests and benchmarks share, re-exported here.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from leyline_agent.launch import Served, ServerProcess, free_port, serve_vllm, wait_ready
from leyline_agent.launch import serve_leyline as serve_in_process

__all__ = [
    "ServerProcess",
    "ThreadServer",
    "free_port",
    "serve_in_process",
    "serve_in_thread",
    "serve_vllm",
    "wait_ready",
]


@dataclass
class ThreadServer(Served):
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
