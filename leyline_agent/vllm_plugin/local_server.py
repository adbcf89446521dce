"""Start ``vllm serve`` (with or without the plugin) as a subprocess on loopback.

Used by the live tests and the side-by-side benchmark; imports neither torch nor vLLM. The
binary is ``.venv-vllm/bin/vllm`` (``scripts/setup_vllm.sh``) unless ``vllm`` is given.
CPU defaults: both cores for compute (``VLLM_CPU_OMP_THREADS_BIND=0-1``), fp32, eager.
With ``tensor_parallel_size=2`` vLLM starts one worker per rank (gloo on CPU) and the
default binding gives each rank one core (``0|1``: vLLM splits the binding at ``|``, one
part per rank); other sizes need a binding of your own in ``VLLM_CPU_OMP_THREADS_BIND``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from leyline_agent.errors import RuntimeUnavailableError

__all__ = ["QUIET_AFTER_REQUEST_S", "VLLMServer", "default_vllm", "free_port", "serve_vllm"]

# After a request, ``vllm serve``'s CPU engine keeps about one core busy for about a second
# (``/proc/stat`` sampled every 100 ms: ~1 core busy up to 1.2 s after a 0.3 s request, ~0
# after). On a 2-core machine a second server's request made in that time runs beside it:
# alternating three vanilla servers gave TTFTs of 0.1-1.05 s for steps that take 0.1-0.2 s
# on one server alone. Benchmarks that interleave servers pause this long between them.
QUIET_AFTER_REQUEST_S = 1.5

_ROOT = Path(__file__).resolve().parents[2]


def default_vllm() -> Path:
    return Path(os.environ.get("LEYLINE_VLLM_BIN", _ROOT / ".venv-vllm" / "bin" / "vllm"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class VLLMServer:
    url: str
    model: str
    log_path: Path
    process: subprocess.Popen

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


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
) -> Iterator[VLLMServer]:
    """``vllm serve`` on a free loopback port, up and healthy; stopped on exit. ``env``:
    variables set for the server over this process's (e.g. ``LEYLINE_PIN_TTL_S``)."""
    exe = Path(vllm) if vllm else default_vllm()
    if not exe.exists():
        raise RuntimeUnavailableError(f"vllm: {exe} not found (run scripts/setup_vllm.sh)")
    port = free_port()
    args = [
        str(exe), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
        "--enable-prompt-tokens-details", "--served-model-name", Path(model_dir).name,
    ]  # fmt: skip
    if block_size:
        args += ["--block-size", str(block_size)]
    if tensor_parallel_size != 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    args += list(extra_args)
    env = {**os.environ, **(env or {})}
    binds = {1: "0-1", 2: "0|1"}
    if "VLLM_CPU_OMP_THREADS_BIND" not in env and tensor_parallel_size not in binds:
        raise RuntimeUnavailableError(
            f"tensor_parallel_size: {tensor_parallel_size} needs VLLM_CPU_OMP_THREADS_BIND "
            "(one core list per rank, separated by |)"
        )
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", binds.get(tensor_parallel_size, ""))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["VLLM_PLUGINS"] = "leyline" if leyline else ""
    log = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    srv = VLLMServer(f"http://127.0.0.1:{port}", Path(model_dir).name, log, proc)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeUnavailableError(
                    f"vllm serve exited ({proc.returncode}):\n{srv.log_tail()}"
                )
            try:
                if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeUnavailableError(
                    f"vllm serve not up in {startup_timeout_s}s:\n{srv.log_tail()}"
                )
            time.sleep(1.0)
        yield srv
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
