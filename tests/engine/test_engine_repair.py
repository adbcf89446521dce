"""REPAIR on real (tiny, fp32) transformers models, against independent truths.

- budget 1: every tail row recomputed is a fresh prefill of ``T'``: transformers' own
  forward of ``T'`` (``plain_kv``) and the engine's FORGET agree with it;
- budget 0: nothing recomputed is AMORTIZE: the engine's AMORTIZE rows, bitwise, and the
  literal AMORTIZE construction of ``test_engine_splice``;
- selector ``first`` at a partial budget: the recomputed rows, every row before them exact
  or recomputed, equal transformers' K/V for those rows in a fresh prefill of ``T'`` (the
  oracle); the rows after them do not (the test can fail).
"""

from __future__ import annotations

import math

import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine, SamplingParams
from leyline_agent.reference.kv_reference import logits_from_kv, plain_kv
from leyline_agent.wire import DirectivesRequest

pytestmark = pytest.mark.slow

ARCHS = ["deepseek_v2", "llama", "qwen3"]
TOL = 1e-5
S, E = 20, 41


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


def spliced(arch, mode: str, budget: float | None = None, **kw):
    eng = Engine.from_pretrained(tiny_model_dir(arch), **kw)
    msgs = [
        {"role": "system", "content": "You are a careful debugging agent."},
        {"role": "user", "content": "The test in test_purr.py fails; find the bug."},
        {"role": "assistant", "content": "Let me run it."},
        {"role": "tool", "content": "FAILED test_purr.py::test_sum - assert 6305 == 6306\n" * 2},
        {"role": "assistant", "content": "The command printed 6305, expected 6306."},
    ]
    T = eng.render(msgs, add_generation_prompt=False)
    eng.generate(T, SamplingParams(max_tokens=0))
    R = [101, 102, 103, 104, 105, 106, 107]
    d = {"start": S, "end": E, "replacement": R, "mode": mode}
    if budget is not None:
        d["budget"] = budget
    resp = eng.apply_directives(DirectivesRequest(tokens=T, directives=[d]))
    Tp = T[:S] + R + T[E:]
    assert resp.tokens == Tp
    return eng, resp, Tp


def pool_kv(eng: Engine, tokens: list[int]):
    m = eng.cache.tree.match_prefix(tokens)
    assert m.length == len(tokens)
    return eng.pool.as_cache_data(m.slots)


def diff(a, b, rows: slice = slice(None)) -> float:
    return max(
        (x[:, :, rows] - y[:, :, rows]).abs().max().item()
        for p, q in zip(a, b, strict=True)
        for x, y in zip(p, q, strict=True)
    )


def test_budget_one_is_a_fresh_prefill(arch, ref_model):
    eng, resp, Tp = spliced(arch, "repair", 1.0)
    tail = len(Tp) - S - 7
    assert resp.splices["repair"] == 1 and resp.repaired_tokens == tail
    assert diff(pool_kv(eng, Tp), plain_kv(ref_model, Tp)) <= TOL
    forget, _, _ = spliced(arch, "forget")
    assert diff(pool_kv(eng, Tp), pool_kv(forget, Tp)) <= TOL
    Q = eng.render([{"role": "user", "content": "And now?"}], add_generation_prompt=True)
    want = logits_from_kv(ref_model, plain_kv(ref_model, Tp), Q)
    assert (eng.logits_for(Tp + Q) - want).abs().max().item() <= 1e-4
    st = eng.stats()
    assert st.repaired_tokens == tail and st.splices["repair"] == 1


def test_budget_zero_is_amortize(arch):
    eng, resp, Tp = spliced(arch, "repair", 0.0)
    assert resp.repaired_tokens == 0
    amortized, ref, _ = spliced(arch, "amortize")
    assert diff(pool_kv(eng, Tp), pool_kv(amortized, Tp)) == 0.0
    assert resp.rotated_tokens == ref.rotated_tokens and resp.prefilled_tokens == len(Tp[S:S + 7])


def test_recomputed_rows_equal_a_fresh_prefill(arch, ref_model):
    """Selector ``first``: rows ``[S+|R|, S+|R|+k)`` recomputed over an exact prefix."""
    budget = 0.3
    eng, resp, Tp = spliced(arch, "repair", budget, repair_selector="first")
    lo = S + 7
    k = math.ceil(budget * (len(Tp) - lo))
    assert resp.repaired_tokens == k
    got, want = pool_kv(eng, Tp), plain_kv(ref_model, Tp)
    assert diff(got, want, slice(0, lo + k)) <= TOL
    assert diff(got, want, slice(lo + k, None)) > 1e-3  # the rest kept its stale rows


def test_default_budget_and_refusals(arch):
    eng, resp, Tp = spliced(arch, "repair")  # the engine's default budget
    tail = len(Tp) - S - 7
    assert resp.repaired_tokens == math.ceil(eng.repair_budget * tail)
    with pytest.raises(ValueError, match="budget"):
        DirectivesRequest(
            tokens=Tp, directives=[{"start": 1, "end": 2, "mode": "amortize", "budget": 0.5}]
        )
    with pytest.raises(ValueError, match="budget"):
        DirectivesRequest(
            tokens=Tp, directives=[{"start": 1, "end": 2, "mode": "repair", "budget": 1.5}]
        )
