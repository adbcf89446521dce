"""A splice inside a live ``vllm serve`` equals an independent AMORTIZE, and is served from
vLLM's prefix cache; FORGET equals a fresh prefill.

Ground truth (``conftest.Live.truth``): ``RefState`` from transformers, the tail's pre-RoPE
keys re-rotated at their new positions by the model's own rotary function. vLLM holds
``T'`` in full blocks only, so the truth keeps the spliced rows of those blocks and
prefills the rest of the prompt over them, as vLLM's next request does.
"""

from __future__ import annotations

import pytest

from leyline_agent.reference.kv_reference import RefState

TOL = 1e-4


@pytest.fixture(params=["llama", "qwen3"])
def live(request):
    return request.getfixturevalue(request.param)


def test_amortize_equals_the_independent_truth_and_is_served_from_cache(live):
    b = live.block
    t, r, x = live.ids(11, 5 * b), live.ids(12, 10), live.ids(13, 1)
    s, e = 40, 70  # inside blocks 1 and 2; delta = -20
    live.complete(t)  # T is cached in full blocks (5 of them)
    resp = live.directive({"tokens": t, "directives": [{"start": s, "end": e, "replacement": r}]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    new = t[:s] + r + t[e:]
    assert body["tokens"] == new and body["splices"] == {"amortize": 1, "forget": 0}
    got_cached, got = live.complete(new + x)
    full = (len(new) // b) * b  # every full block of T' (a vanilla engine: up to block 1)
    assert got_cached == full and full > (s // b) * b
    assert body["rotated_tokens"] == full - (s + len(r))
    truth = live.truth(RefState.prefill(live.model, t).amortize(s, e, r), full, new[full:] + x)
    fresh = live.truth(RefState.prefill(live.model, new), full, new[full:] + x)
    assert live.max_err(got, truth) <= TOL
    assert live.max_err(got, fresh) > 100 * TOL  # the truth tells a splice from a re-prefill


def test_forget_equals_a_fresh_prefill(live):
    b = live.block
    t, r, x = live.ids(21, 5 * b), live.ids(22, 7), live.ids(23, 1)
    s, e = 64, 90  # FORGET re-prefills from the start of the block holding s
    live.complete(t)
    resp = live.directive(
        {"tokens": t, "directives": [{"start": s, "end": e, "replacement": r, "mode": "forget"}]}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["splices"] == {"amortize": 0, "forget": 1}
    new = t[:s] + r + t[e:]
    got_cached, got = live.complete(new + x)
    full = (len(new) // b) * b
    assert got_cached == full
    truth = live.truth(RefState.prefill(live.model, new), full, new[full:] + x)
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
    # after the first splice vLLM holds mid in full blocks (160 rows); the second splice's tail
    # is what of them follows its span: T'' is held through (35 + 160 - 50) // 32 blocks
    held = ((30 + len(r2) + (len(mid) // b) * b - 50) // b) * b
    got_cached, got = live.complete(new + x)
    assert got_cached == held
    ref = RefState.prefill(live.model, t).amortize(120, 150, r1).amortize(30, 50, r2)
    truth = live.truth(ref, held, new[held:] + x)
    assert live.max_err(got, truth) <= TOL
