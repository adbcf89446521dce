"""The two live servers of the conformance suite, side by side, on one >= 3-layer checkpoint.

``leyline serve`` (the embedded engine, started with ``.venv``'s Python) and ``vllm serve``
with the Leyline plugin (``.venv-vllm``), both on the 4-layer llama ``mini`` checkpoint,
both behind ``--api-key KEY``, both on loopback. vLLM runs at two block sizes, one after
the other (``BLOCKS``: 32, the smallest its CPU backend takes, and 128, its default
there): every test that uses ``both`` runs against each. A third vLLM configuration,
tensor parallelism 2 at block 32 (``TP2``: two worker ranks over gloo, one core each),
runs the core cases only: a test opts in with ``@pytest.mark.parametrize("vllm_srv",
CONFIGS, indirect=True)`` (the chains against the oracle, the block-boundary splice, the
bad-input statuses); the other tests run on the ``TP1`` configurations. ``make test`` runs
this folder with ``.venv-vllm``'s pytest (it needs both venvs: vLLM for one server,
transformers for the oracle); the main run ignores it.

``Srv`` is one server seen over plain HTTP: posts with the key, completions by token ids
that return ``(cached_tokens, sampled logprob, the top-20 logprobs sorted)``: values, not
token texts, so the two detokenizers cannot make a difference.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import vllm  # noqa: F401  (this folder needs the vLLM venv: fail loudly, never skip)

from leyline_agent.engine.checkpoints.store import model_dir
from leyline_agent.testing.server import ServerProcess, serve_in_process, serve_vllm

KEY = "sk-conformance"
BLOCKS = [32, 128]
# vLLM configurations: "block<size>" (TP = 1) and "block32-tp2" (TP = 2). Plain strings so
# that a test's indirect parametrization and the fixture's own params share one server.
TP1 = [f"block{b}" for b in BLOCKS]
TP2 = "block32-tp2"
CONFIGS = [*TP1, TP2]
TOP = 20
ROOT = Path(__file__).resolve().parents[2]
SERVERS = ["leyline", "vllm"]


@dataclass
class Srv:
    name: str
    url: str
    model: str
    block: int | None  # vLLM's block size (None: the embedded engine)
    client: httpx.Client

    def post(
        self,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        session: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        h = dict(headers or {})
        if session is not None:
            h["X-Leyline-Session"] = session
        if raw is not None:
            h.setdefault("content-type", "application/json")
            return self.client.post(self.url + path, content=raw, headers=h)
        return self.client.post(self.url + path, json=body, headers=h)

    def directive(self, body: Any, session: str | None = None) -> httpx.Response:
        return self.post("/leyline/v1/directives", body, session=session)

    def stats(self) -> dict[str, Any]:
        r = self.client.get(self.url + "/leyline/v1/stats")
        assert r.status_code == 200, r.text
        return r.json()

    def complete(
        self, prompt: list[int], session: str | None = None
    ) -> tuple[int, float, list[float]]:
        r = self.post("/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "logprobs": TOP,
        }, session=session)  # fmt: skip
        assert r.status_code == 200, (self.name, r.text)
        j = r.json()
        lp = j["choices"][0]["logprobs"]
        top = sorted(lp["top_logprobs"][0].values(), reverse=True)
        return j["usage"]["prompt_tokens_details"]["cached_tokens"], lp["token_logprobs"][0], top


@pytest.fixture(scope="session")
def ckpt() -> Path:
    return model_dir("llama", "mini")  # 4 layers: a wrong context for R shows


@pytest.fixture(scope="session")
def oracle(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def client() -> httpx.Client:
    """An HTTP client that sends the key."""
    return httpx.Client(timeout=300, headers={"Authorization": f"Bearer {KEY}"})


def leyline_process(ckpt: Path, *extra: str, ready: bool = True) -> ServerProcess:
    """``leyline serve`` of ``ckpt`` (``.venv``'s Python) behind ``--api-key KEY`` on a free
    loopback port, with ``extra`` arguments; a context manager that stops it."""
    py = os.environ.get("LEYLINE_MAIN_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    log = tempfile.mkstemp(prefix="leyline-conformance-", suffix=".log")[1]
    return serve_in_process(
        ckpt, "--api-key", KEY, "--served-model-name", ckpt.name, *extra, python=py,
        env={"OMP_NUM_THREADS": "1"}, log_path=log, timeout=300, ready=ready,
    )  # fmt: skip


@pytest.fixture(scope="session")
def start_leyline() -> Any:
    """``leyline_process`` and ``client``, for modules that start servers of their own."""
    return leyline_process, client


@pytest.fixture(scope="session")
def leyline_srv(ckpt):
    with leyline_process(ckpt) as srv, client() as c:
        yield Srv("leyline", srv.url, ckpt.name, None, c)


def _config(name: str) -> tuple[int, int]:
    """``(block size, tensor parallel size)`` of a configuration name."""
    head, _, tp = name.partition("-tp")
    return int(head.removeprefix("block")), int(tp or 1)


@pytest.fixture(scope="session", params=TP1, ids=TP1)
def vllm_srv(request, ckpt, leyline_srv):  # after leyline serve: one heavy start at a time
    b, tp = _config(request.param)  # pytest stops one configuration's server before the next
    args = ["--api-key", KEY]
    with (
        serve_vllm(ckpt, block_size=b, tensor_parallel_size=tp, extra_args=args) as s,
        client() as c,
    ):
        yield Srv("vllm" if tp == 1 else f"vllm-tp{tp}", s.url, s.model, b, c)


@pytest.fixture(scope="session")
def both(leyline_srv, vllm_srv) -> list[Srv]:
    return [leyline_srv, vllm_srv]
