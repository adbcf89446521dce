"""The one launcher of real servers on loopback, for tests and benchmarks.

- ``serve_leyline(model_dir, *args)``: ``python -m leyline_agent.cli serve --model DIR --port P
  *args`` in a child process (the real command line).
- ``serve_vllm(model_dir, ...)``: ``vllm serve`` (``.venv-vllm/bin/vllm`` unless ``vllm`` or
  ``LEYLINE_VLLM_BIN`` says otherwise), with or without the Leyline plugin. CPU defaults: both
  cores for compute (``VLLM_CPU_OMP_THREADS_BIND=0-1``), fp32, eager. With
  ``tensor_parallel_size=2`` vLLM starts one worker per rank (gloo on CPU) and the default
  binding gives each rank one core (``0|1``: vLLM splits the binding at ``|``, one part per
  rank); other sizes need a binding of their own in ``VLLM_CPU_OMP_THREADS_BIND``.

Both wait for ``/health`` (``wait_ready``; a child that exits first fails at once, with its
log's tail) and return a ``ServerProcess``: its URLs, its log, and ``stop()`` (SIGTERM, a
clean shutdown, then SIGKILL after ``timeout``), also on leaving a ``with`` block. Neither
imports torch nor vLLM. ``leyline_agent.testing.server`` adds an in-process (thread) server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from leyline_agent.errors import RuntimeUnavailableError

__all__ = [
    "QUIET_AFTER_REQUEST_S",
    "Served",
    "ServerProcess",
    "default_vllm",
    "free_port",
    "serve_leyline",
    "serve_vllm",
    "wait_ready",
]

# After a request, ``vllm serve``'s CPU engine keeps about one core busy for about a second
# (``/proc/stat`` sampled every 100 ms: ~1 core busy up to 1.2 s after a 0.3 s request, ~0
# after). On a 2-core machine a second server's request made in that time runs beside it:
# alternating three vanilla servers gave TTFTs of 0.1-1.05 s for steps that take 0.1-0.2 s
# on one server alone. Benchmarks that interleave servers pause this long between them.
QUIET_AFTER_REQUEST_S = 1.5

_ROOT = Path(__file__).resolve().parents[1]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_ready(
    base_url: str, timeout: float, alive: Callable[[], bool] | None = None, poll_s: float = 0.1
) -> None:
    """Poll ``/health`` every ``poll_s`` until it answers 200 (``alive()`` false: give up at
    once)."""
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
        time.sleep(poll_s)
    raise TimeoutError(f"the server at {base_url} was not ready after {timeout}s ({last})")


class Served:
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
class ServerProcess(Served):
    """A server in a child process on ``host:port``. ``group``: the child leads a process
    group of its own (``vllm serve``'s workers), which ``stop`` signals as a whole."""

    host: str
    port: int
    process: subprocess.Popen[bytes] = field(repr=False)
    log_path: Path | None = None
    model: str = ""  # the served model's name (``--served-model-name``), where known
    group: bool = False

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float, poll_s: float = 0.1) -> None:
        """``wait_ready`` on this server; stopped, with its log's tail, if it fails."""
        try:
            wait_ready(self.url, timeout, lambda: self.process.poll() is None, poll_s)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeUnavailableError(f"{e}\n{self.log_tail()}") from None
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        self._signal(signal.SIGTERM)  # uvicorn (and vLLM) shut down cleanly on SIGTERM
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait(timeout)

    def _signal(self, sig: signal.Signals) -> None:
        if self.group:
            os.killpg(self.process.pid, sig)
        else:
            self.process.send_signal(sig)


def _start(
    cmd: Sequence[str],
    port: int,
    host: str,
    env: Mapping[str, str],
    log_path: str | Path | None,
    *,
    group: bool = False,
    model: str = "",
) -> ServerProcess:
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=subprocess.STDOUT, env=dict(env),
            start_new_session=group,
        )  # fmt: skip
    finally:
        if log_path:
            out.close()  # type: ignore[union-attr]
    log = Path(log_path) if log_path else None
    return ServerProcess(host, port, proc, log, model=model, group=group)


def serve_leyline(
    model_dir: str | Path,
    *args: str,
    port: int | None = None,
    connect_host: str = "127.0.0.1",
    timeout: float = 120.0,
    log_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    ready: bool = True,
) -> ServerProcess:
    """``leyline serve --model model_dir --port P *args`` in a child process.

    ``args`` are passed as given (no ``--host`` is added: the command's default applies).
    ``connect_host`` is where this helper looks for it. ``python``: the interpreter (this
    one by default). ``ready=False``: return at once, the caller waits
    (``ServerProcess.wait_ready``), so that the start can overlap another server's.
    """
    port = free_port(connect_host) if port is None else port
    cmd = [python or sys.executable, "-m", "leyline_agent.cli", "serve",
           "--model", str(model_dir), "--port", str(port), *args]  # fmt: skip
    srv = _start(cmd, port, connect_host, {**os.environ, **(env or {})}, log_path)
    if ready:
        srv.wait_ready(timeout)
    return srv


def default_vllm() -> Path:
    return Path(os.environ.get("LEYLINE_VLLM_BIN", _ROOT / ".venv-vllm" / "bin" / "vllm"))


@contextmanager
def serve_vllm(
    model_dir: str | Path,
    *,
    leyline: bool = True,
    block_size: int | None = None,
    extra_args: Sequence[str] = (),
    vllm: str | Path | None = None,
    kv_cache_gib: int = 1,
    max_model_len: int = 4096,
    tensor_parallel_size: int = 1,
    startup_timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[ServerProcess]:
    """``vllm serve`` on a free loopback port, up and healthy; stopped on exit. ``env``:
    variables set for the server over this process's (e.g. ``LEYLINE_PIN_TTL_S``)."""
    exe = Path(vllm) if vllm else default_vllm()
    if not exe.exists():
        raise RuntimeUnavailableError(f"vllm: {exe} not found (run scripts/setup_vllm.sh)")
    port, name = free_port(), Path(model_dir).name
    args = [
        str(exe), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
        "--enable-prompt-tokens-details", "--served-model-name", name,
    ]  # fmt: skip
    if block_size:
        args += ["--block-size", str(block_size)]
    if tensor_parallel_size != 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    args += list(extra_args)
    full = {**os.environ, **(env or {})}
    binds = {1: "0-1", 2: "0|1"}
    if "VLLM_CPU_OMP_THREADS_BIND" not in full and tensor_parallel_size not in binds:
        raise RuntimeUnavailableError(
            f"tensor_parallel_size: {tensor_parallel_size} needs VLLM_CPU_OMP_THREADS_BIND "
            "(one core list per rank, separated by |)"
        )
    full.setdefault("VLLM_CPU_OMP_THREADS_BIND", binds.get(tensor_parallel_size, ""))
    full.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    full.setdefault("HF_HUB_OFFLINE", "1")
    full["VLLM_PLUGINS"] = "leyline" if leyline else ""
    log = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1]
    srv = _start(args, port, "127.0.0.1", full, log, group=True, model=name)
    srv.wait_ready(startup_timeout_s, poll_s=1.0)  # minutes of start: a poll a second
    try:
        yield srv
    finally:
        srv.stop()
