"""A splice inside a live ``vllm serve`` equals an independent AMORTIZE, and is served from
vLLM's prefix cache; FORGET equals a fresh prefill.

Ground truth (``conftest.Live.truth``): ``RefState`` from transformers, the tail's pre-RoPE
keys re-rotated at their new positions by the model's own rotary function. vLLM caches
full blocks only; the plugin holds the rows of ``T'`` past its last full block and hands
them to the next request (``held_rows``, ``connector``), so every row of ``T'`` is served
from cache and the truth keeps all of them.
"""

from __future__ import annotations

import pytest

from leyline_agent.reference.kv_reference import RefState

TOL = 1e-4


def _engine_prompt_tokens(live) -> float:
    """vLLM's own count of the prompt tokens its requests carried (``/metrics``)."""
    text = live.client.get(live.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_total")
    )


@pytest.fixture(params=["llama", "qwen3"])
def live(request):
    return request.getfixturevalue(request.param)


def test_amortize_equals_the_independent_truth_and_is_served_from_cache(live):
    b = live.block
    t, r, x = live.ids(11, 5 * b), live.ids(12, 10), live.ids(13, 1)
    s, e = 40, 70  # inside blocks 1 and 2; delta = -20
    live.complete(t)  # T is cached in full blocks (5 of them)
    before = _engine_prompt_tokens(live)
    resp = live.directive({"tokens": t, "directives": [{"start": s, "end": e, "replacement": r}]})
    assert resp.status_code == 200, resp.text
    # llama's layers are the plugin's row forward's: R's rows are computed inside the splice
    # op, no request of the engine; qwen3's are not: R comes from a head request T[:s] + R
    head = 0 if "llama" in live.srv.model else s + len(r)
    assert _engine_prompt_tokens(live) - before == head
    body = resp.json()
    new = t[:s] + r + t[e:]
    assert body["tokens"] == new and body["splices"] == {"amortize": 1, "forget": 0}
    got_cached, got = live.complete(new + x)
    assert len(new) % b  # T' ends inside a block: its last rows are the held ones
    assert got_cached == len(new)  # every row of T' (a vanilla engine: up to block 1)
    assert body["rotated_tokens"] == len(new) - (s + len(r))
    truth = live.truth(RefState.prefill(live.model, t).amortize(s, e, r), len(new), x)
    fresh = live.truth(RefState.prefill(live.model, new), len(new), x)
    assert live.max_err(got, truth) <= TOL
    assert live.max_err(got, fresh) > 100 * TOL  # the truth tells a splice from a re-prefill


def test_forget_equals_a_fresh_prefill(live):
    b = live.block
    t, r, x = live.ids(21, 5 * b), live.ids(22, 7), live.ids(23, 1)
    s, e = 70, 90  # inside block 2: T[64:70] are kept (exact rows here, so = a fresh prefill)
    live.complete(t)
    resp = live.directive(
        {"tokens": t, "directives": [{"start": s, "end": e, "replacement": r, "mode": "forget"}]}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["splices"] == {"amortize": 0, "forget": 1}
    new = t[:s] + r + t[e:]
    got_cached, got = live.complete(new + x)
    assert got_cached == len(new)
    truth = live.truth(RefState.prefill(live.model, new), len(new), x)
    assert live.max_err(got, truth) <= TOL


def test_a_batch_of_two_directives_equals_two_amortizes_right_to_left(llama):
    live, b = llama, llama.block
    t, r1, r2, x = live.ids(51, 6 * b), live.ids(52, 20), live.ids(53, 5), live.ids(54, 1)
    live.complete(t)
    body = {"tokens": t, "directives": [
        {"start": 30, "end": 50, "replacement": r2}, {"start": 120, "end": 150, "replacement": r1},
    ]}  # fmt: skip
    resp = live.directive(body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["splices"] == {"amortize": 2, "forget": 0}
    mid = t[:120] + r1 + t[150:]
    new = mid[:30] + r2 + mid[50:]
    # the first splice leaves mid's rows past its last full block held; the second splice
    # takes its tail from them: every row of T'' is kept
    held = len(new)
    got_cached, got = live.complete(new + x)
    assert got_cached == held
    ref = RefState.prefill(live.model, t).amortize(120, 150, r1).amortize(30, 50, r2)
    truth = live.truth(ref, held, new[held:] + x)
    assert live.max_err(got, truth) <= TOL
