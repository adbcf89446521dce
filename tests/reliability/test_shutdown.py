"""A shutdown that keeps its word, even in the middle of a long prefill.

1. A real ``leyline serve`` on the ``mini`` checkpoint gets SIGTERM 4 s into a 6,000-token
   prefill (about 90 s of work here, in chunks of up to 13 s): the waiting client gets a 503
   in OpenAI's error shape with ``Retry-After``, a new request is refused (no connection) or
   gets a 503, and the process exits within ``--shutdown-timeout-s`` + 5 s.
2. Nothing half-written is left behind. The cache lives in the process's memory only (KV
   pool and radix tree; nothing is saved), so a restart starts empty by construction; what
   can be checked is the same process after a prefill stopped between two chunks
   (``Engine.stop_generations``, as the shutdown deadline calls it): the stop came while the
   prompt was still being prefilled, at most one more step ran, the prefix cache holds no row
   of the prompt, every slot is free again, and a fresh engine serving the same prompt
   answers a plain transformers forward (1e-4).
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
import torch

from leyline_agent.engine.checkpoints.store import model_dir as checkpoint_dir
from leyline_agent.testing.server import serve_in_process
from leyline_agent.testing.token_ids import random_ids

TIMEOUT_S = 2.0
PROMPT = 6000


def test_sigterm_during_a_long_prefill_answers_503_and_exits_in_time(tmp_path):
    mini = checkpoint_dir("deepseek_v2", "mini")
    srv = serve_in_process(
        mini, "--shutdown-timeout-s", str(TIMEOUT_S), log_path=tmp_path / "serve.log"
    )
    out: dict = {}

    def ask() -> None:
        body = {"model": mini.name, "prompt": random_ids(7, PROMPT), "max_tokens": 4}
        try:
            out["r"] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=300)
        except httpx.HTTPError as e:
            out["r"] = e

    try:
        client = threading.Thread(target=ask)
        client.start()
        time.sleep(4.0)
        assert client.is_alive(), f"the prefill ended within 4 s: {out}"
        t0 = time.monotonic()
        srv.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:  # a new request once the shutdown began: refused, or a 503
            late = httpx.post(f"{srv.url}/v1/completions", json={"model": mini.name,
                              "prompt": [5, 6], "max_tokens": 1}, timeout=30)  # fmt: skip
            assert late.status_code == 503, late.text
        except httpx.TransportError:
            pass
        srv.process.wait(TIMEOUT_S + 60)
        exited_s = time.monotonic() - t0
        client.join(30)
    finally:
        srv.stop()
    log = (tmp_path / "serve.log").read_text(errors="replace")[-2000:]
    assert exited_s < TIMEOUT_S + 5, f"exited {exited_s:.1f}s after SIGTERM\n{log}"
    r = out["r"]
    assert isinstance(r, httpx.Response), f"no answer: {r!r}\n{log}"
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) >= 1
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert "shutting down" in error["message"], error


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_a_prefill_stopped_between_chunks_leaves_nothing_in_the_cache(model_dir, hf):
    from leyline_agent.engine.engine import Engine, GenerationStopped
    from leyline_agent.engine.params import SamplingParams
    from leyline_agent.engine.sequence import SeqStatus
    from leyline_agent.namespaces import ANONYMOUS

    ids = random_ids(11, 1500)
    engine = Engine.from_pretrained(model_dir)
    engine.stepper.step_tokens = 32  # many chunks, so the stop lands between two of them
    free = engine.allocator.num_used
    failed: dict = {}

    def run() -> None:
        try:
            engine.generate(ids, SamplingParams(max_tokens=4))
        except GenerationStopped as e:
            failed["e"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while engine.stepper.steps < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    running = list(engine.stepper.running)
    assert running and running[0].status is SeqStatus.PREFILL, "the prefill was not running"
    steps = engine.stepper.steps
    engine.stop_generations()
    t.join(60)
    assert "e" in failed, "the generation was not stopped"
    assert engine.stepper.steps <= steps + 1  # it stopped at the next chunk boundary
    assert engine.stepper.steps * 32 < len(ids)  # with most of the prompt never computed
    assert engine.cache.match(ids, ANONYMOUS).length == 0
    assert engine.allocator.num_used == free

    fresh = Engine.from_pretrained(model_dir)  # a restart: a new engine, an empty cache
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=True)
    got = fresh.generate(ids, params).logprobs[0]
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([ids])).logits[0, -1].float()
    want = float(torch.log_softmax(logits, -1).max())
    assert abs(got.logprob - want) < 1e-4, (got, want)
