"""Live vLLM servers for the plugin's tests (``.venv-vllm`` only; ``make test`` runs this
folder with that venv's pytest, the main run ignores it).

One ``vllm serve`` per tiny checkpoint and session, on 127.0.0.1, with the plugin
(``VLLM_PLUGINS=leyline``), block size 32 (the CPU kernels take multiples of 32; 128, the
default, would make the tiny prompts one block). ``Live`` wraps one server: completions by
token ids with top-20 logprobs keyed by token id, directives, stats, and the ground truth
from transformers (``leyline_agent.reference.kv_reference``: the model's own modules and
rotary function, nothing of the plugin).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
import vllm  # noqa: F401  (this folder needs the vLLM venv: fail loudly, never skip)

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.reference.kv_reference import RefState, logits_from_kv
from leyline_agent.testing.server import ServerProcess, serve_vllm

BLOCK = 32
TOP = 20


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 5990) for _ in range(n)]


@dataclass
class Live:
    srv: ServerProcess
    model: Any  # transformers model: the ground truth
    client: httpx.Client
    block: int = BLOCK

    @staticmethod
    def ids(seed: int, n: int) -> list[int]:
        return ids(seed, n)

    @staticmethod
    def max_err(got: dict[int, float], truth: torch.Tensor) -> float:
        return max_err(got, truth)

    @property
    def url(self) -> str:
        return self.srv.url

    def complete(
        self, prompt: list[int], session: str | None = None
    ) -> tuple[int, dict[int, float]]:
        """(cached_tokens, {token id: logprob} of the next token's top 20)."""
        headers = {"X-Leyline-Session": session} if session else {}
        r = self.client.post(
            self.url + "/v1/completions",
            json={"model": self.srv.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                  "logprobs": TOP, "return_tokens_as_token_ids": True},
            headers=headers,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        j = r.json()
        top = j["choices"][0]["logprobs"]["top_logprobs"][0]
        return j["usage"]["prompt_tokens_details"]["cached_tokens"], {
            int(k.removeprefix("token_id:")): v for k, v in top.items()
        }

    def directive(self, body: Any, session: str | None = None) -> httpx.Response:
        headers = {"X-Leyline-Session": session} if session else {}
        return self.client.post(self.url + "/leyline/v1/directives", json=body, headers=headers)

    def stats(self) -> dict[str, Any]:
        return self.client.get(self.url + "/leyline/v1/stats").json()

    def truth(self, state: RefState, cached: int, rest: list[int]) -> torch.Tensor:
        """Next-token log-probs after ``state``'s first ``cached`` rows (as vLLM holds them)
        with ``rest`` prefilled over them: fp64 log-softmax of transformers' logits."""
        head = RefState(
            self.model, state.tokens[:cached],
            [p[:, :, :cached] for p in state.plain], [p[:, :, :cached] for p in state.pre],
        )  # fmt: skip
        if cached:
            logits = logits_from_kv(self.model, head.kv(), rest)
        else:
            with torch.inference_mode():
                logits = self.model(input_ids=torch.tensor([rest])).logits[0, -1]
        return torch.log_softmax(logits.double(), -1)


def max_err(got: dict[int, float], truth: torch.Tensor) -> float:
    return max(abs(v - float(truth[k])) for k, v in got.items())


def _live(arch: str, **kw: Any):
    from transformers import AutoModelForCausalLM

    d = tiny_model_dir(arch)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with serve_vllm(d, block_size=BLOCK, **kw) as srv, httpx.Client(timeout=120) as client:
        yield Live(srv, model, client)


@pytest.fixture(scope="session")
def llama():
    yield from _live("llama")


@pytest.fixture(scope="session")
def qwen3():
    yield from _live("qwen3")
