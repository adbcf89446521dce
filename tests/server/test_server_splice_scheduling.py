"""A splice is scheduled work: another session's stream keeps producing tokens while one
session's 4,000-token replacement (AMORTIZE) is prefilled, over real HTTP.

The model is the tiny DeepSeek-V2 made three layers deep (so a wrong context for ``R``
would show in the next request's logits). Session A streams greedy completions back to
back; its solo inter-token gaps are measured first, on the same server, then again while
session B splices. The splice must not stop the stream: tokens keep arriving all through it
(a splice that stops the engine lets through none); the median gap stays within 2.5x the
solo median and the 90th percentile within 3x the solo one. The largest gap is printed
beside the largest solo gap, not asserted: on a shared 2-core machine single stalls of
50-300 ms come from other processes, solo as well (the pacing decisions that keep a splice
from making such a stall itself are checked without timing in ``test_engine_pace.py``).
The spliced result is then compared with an independent AMORTIZE
(``reference.kv_reference.RefState``: the model's own modules, never the engine's code).
"""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest
import torch

from leyline_agent.experiments.bench.bench_splice_stream import gaps, stream_until
from leyline_agent.reference.kv_reference import RefState, logits_from_kv
from leyline_agent.testing.server import serve_in_thread
from leyline_agent.testing.token_ids import random_ids

pytestmark = [pytest.mark.slow, pytest.mark.timing]  # p50/p90 beside a solo run

R_LEN = 4000
START, END = 40, 50


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    """The tiny DeepSeek-V2 checkpoint with three layers (seeded weights, same tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from leyline_agent.engine.checkpoints.store import tiny_model_dir

    src = tiny_model_dir("deepseek_v2")
    cfg = AutoConfig.from_pretrained(src)
    cfg.num_hidden_layers = 3
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig.from_pretrained(src)
    out = tmp_path_factory.mktemp("deepseek_v2-3layers")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def served(deep_dir):
    from leyline_agent.engine.engine import Engine

    old = torch.get_num_threads()
    torch.set_num_threads(1)  # steady step times on a shared 2-core machine
    try:
        with serve_in_thread(Engine.from_pretrained(deep_dir)) as srv:
            with httpx.Client(base_url=srv.url, timeout=300) as c:
                yield c, deep_dir.name
    finally:
        torch.set_num_threads(old)


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else float("inf")


def _complete(c, name, ids, session, **kw):
    body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0, **kw}
    r = c.post("/v1/completions", json=body, headers={"X-Leyline-Session": session})
    assert r.status_code == 200, r.text
    return r.json()


def _measure(c: httpx.Client, name: str, T: list[int], R: list[int]) -> str:
    """Solo gaps of A's stream, then its gaps while B splices ``R`` into ``T``."""
    _complete(c, name, T, "B")
    stop, solo = threading.Event(), []
    th = threading.Thread(target=stream_until, args=(c, name, stop, solo))
    t0 = time.monotonic()
    th.start()
    time.sleep(2.0)
    stop.set()
    th.join()
    solo_gaps = gaps(solo, t0, time.monotonic())
    assert len(solo_gaps) > 50, len(solo_gaps)

    stop, during = threading.Event(), []
    th = threading.Thread(target=stream_until, args=(c, name, stop, during))
    th.start()
    time.sleep(0.5)
    d = {"start": START, "end": END, "replacement": R, "mode": "amortize"}
    s0 = time.monotonic()
    resp = c.post("/leyline/v1/directives", json={"tokens": T, "directives": [d]},
                  headers={"X-Leyline-Session": "B"})  # fmt: skip
    s1 = time.monotonic()
    time.sleep(0.3)
    stop.set()
    th.join()
    assert resp.status_code == 200, resp.text
    assert resp.json()["prefilled_tokens"] == R_LEN
    spliced = gaps(during, s0, s1)
    solo_p50, solo_max = statistics.median(solo_gaps), max(solo_gaps)
    p50 = statistics.median(spliced) if spliced else float("inf")
    solo_p90, p90 = _p90(solo_gaps), _p90(spliced)
    report = (
        f"splice {s1 - s0:.2f}s; solo gap p50 {solo_p50 * 1e3:.1f} ms p90 {solo_p90 * 1e3:.1f} "
        f"ms max {solo_max * 1e3:.1f} ms; during the splice {len(spliced)} gaps, p50 "
        f"{p50 * 1e3:.1f} ms p90 {p90 * 1e3:.1f} ms max "
        f"{max(spliced, default=float('inf')) * 1e3:.1f} ms"
    )
    # the typical gap while the splice runs stays near the solo one (measured 1.5-1.9x, p90
    # 1.5-2.2x, on a loaded 2-core machine; an exclusive splice gives no gaps, so inf)
    assert p50 < 2.5 * solo_p50, report
    assert p90 < 3 * solo_p90, report
    # the stream kept going all through the splice: at least an eighth of the tokens it
    # would have produced alone (a splice that stops the engine lets through none)
    assert len(spliced) >= (s1 - s0) / solo_p50 / 8, report
    return report


def test_a_long_splice_does_not_stop_another_sessions_stream(served, deep_dir):
    c, name = served
    T, R = random_ids(10, 300), random_ids(20, R_LEN)
    print(_measure(c, name, T, R))

    # the spliced result is exact: the next request of B is served from it and its logits
    # equal an independent AMORTIZE of the same directive
    X = random_ids(3, 5)
    T2 = T[:START] + R + T[END:]
    out = _complete(c, name, T2 + X, "B", logprobs=1)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(T2)
    from leyline_agent.reference.hf_reference import hf_model

    model = hf_model(deep_dir)
    ref = RefState.prefill(model, T).amortize(START, END, R)
    want = torch.log_softmax(logits_from_kv(model, ref.kv(), X), -1)
    tok = int(torch.argmax(want))
    choice = out["choices"][0]
    assert choice["logprobs"]["tokens"] and out["usage"]["completion_tokens"] == 1
    assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(float(want[tok]), abs=1e-4)
