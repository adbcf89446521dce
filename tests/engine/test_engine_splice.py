"""Splices on real (tiny, fp32) transformers models against independent constructions.

AMORTIZE ground truth (the paper's definition): prefix KV from a plain prefill of T[:start], R's KV
from a plain prefill of T[:start] + R, tail latents / values from the original forward of
T, and tail k_pe / keys recomputed from the original PRE-RoPE projections (forward hooks)
at positions i + delta with the model's own rotary functions. FORGET: a plain prefill of T'.
"""

from __future__ import annotations

import random

import pytest
import torch

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine, SamplingParams
from leyline_agent.reference.kv_reference import (
    RefState,
    apply_model_rope,
    greedy_from_kv,
    logits_from_kv,
    plain_kv,
)
from leyline_agent.wire import DirectivesRequest

pytestmark = pytest.mark.slow

ARCHS = ["deepseek_v2", "deepseek_v3", "llama", "qwen3"]
TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


def new_engine(arch, **kw) -> Engine:
    return Engine.from_pretrained(tiny_model_dir(arch), **kw)


def conversation(engine: Engine, n_tool: int = 2) -> list[int]:
    msgs = [
        {"role": "system", "content": "You are a careful debugging agent."},
        {"role": "user", "content": "The test in test_purr.py fails; find the bug."},
    ]
    for k in range(n_tool):
        msgs.append({"role": "assistant", "content": f"Let me look at file {k}."})
        msgs.append(
            {"role": "tool", "content": f"def f{k}(x):\n    return x + {k}  # line {k}\n" * 2}
        )
    return engine.render(msgs, add_generation_prompt=False)


def cache_seq(engine: Engine, ids: list[int]) -> None:
    engine.generate(ids, SamplingParams(max_tokens=0))


def replacement(T: list[int], s: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    r = [rng.randrange(3, 3000) for _ in range(n)]
    if r and s < len(T) and r[0] == T[s]:
        r[0] = (r[0] + 1) % 3000 + 3
    return r


def pool_kv(engine: Engine, tokens: list[int]):
    m = engine.cache.tree.match_prefix(tokens)
    assert m.length == len(tokens)
    return engine.pool.as_cache_data(m.slots)


def max_kv_diff(a, b) -> float:
    return max(
        max((x - y).abs().max().item() for x, y in zip(p, q, strict=True))
        for p, q in zip(a, b, strict=True)
    )


def literal_amortize_reference(model, T, s, e, R):
    """The ground truth of the module docstring, step by step."""
    delta = len(R) - (e - s)
    pre_kv = plain_kv(model, T[:s])
    r_kv = plain_kv(model, T[:s] + R)
    orig = RefState.prefill(model, T)
    mla = model.config.model_type.startswith("deepseek")
    pos = torch.arange(e, len(T)) + delta
    out = []
    for i in range(len(pre_kv)):
        tail_plain = orig.plain[i][:, :, e:]
        tail_rot = apply_model_rope(model, orig.pre[i][:, :, e:], pos)
        tail = (tail_plain, tail_rot) if mla else (tail_rot, tail_plain)
        out.append(
            tuple(torch.cat([pre_kv[i][j], r_kv[i][j][:, :, s:], tail[j]], dim=2) for j in range(2))
        )
    return out


@pytest.mark.parametrize("mode", ["amortize", "forget"])
def test_single_directive_matches_independent_construction(arch, ref_model, mode):
    eng = new_engine(arch)
    T = conversation(eng)
    cache_seq(eng, T)
    s, e = 20, 41  # inside the first tool turn's neighbourhood; R shorter -> tail moves left
    R = replacement(T, s, 7, seed=1)
    resp = eng.apply_directives(
        DirectivesRequest(
            tokens=T, directives=[{"start": s, "end": e, "replacement": R, "mode": mode}]
        )
    )
    Tp = T[:s] + R + T[e:]
    assert resp.tokens == Tp
    if mode == "amortize":
        ref = literal_amortize_reference(ref_model, T, s, e, R)
        assert resp.rotated_tokens == len(T) - e and resp.prefilled_tokens == len(R)
    else:
        ref = plain_kv(ref_model, Tp)
        assert resp.prefilled_tokens == len(R) + len(T) - e and resp.rotated_tokens == 0
    assert max_kv_diff(pool_kv(eng, Tp), ref) <= TOL
    Q = eng.render([{"role": "user", "content": "next turn"}], add_generation_prompt=True)
    got = eng.logits_for(Tp + Q)
    want = logits_from_kv(ref_model, ref, Q)
    assert (got - want).abs().max().item() <= TOL
    res = eng.generate(Tp + Q, SamplingParams(max_tokens=16, stop_token_ids=[]))
    assert res.cached_tokens == len(Tp)
    want_ids = greedy_from_kv(ref_model, ref, Q, 16)
    k = len(res.output_ids)  # may stop early on the end-of-turn token
    assert res.output_ids == want_ids[:k] and k >= 1


def test_amortize_is_not_a_fresh_prefill(arch, ref_model):
    """The test above can fail: AMORTIZE keeps stale tail latents, so it differs from FORGET."""
    eng = new_engine(arch)
    T = conversation(eng)
    cache_seq(eng, T)
    s, e = 20, 41
    R = replacement(T, s, 7, seed=1)
    eng.apply_directives(
        DirectivesRequest(tokens=T, directives=[{"start": s, "end": e, "replacement": R}])
    )
    Tp = T[:s] + R + T[e:]
    assert max_kv_diff(pool_kv(eng, Tp), plain_kv(ref_model, Tp)) > 1e-3


def test_cached_token_accounting(arch):
    eng = new_engine(arch)
    T = conversation(eng)
    s, e = 15, 30
    R = replacement(T, s, 4, seed=2)
    Tp = T[:s] + R + T[e:]
    Q = [5, 6, 7]
    # without the directive: only the common prefix T[:s] is served from the cache
    plain = new_engine(arch)
    cache_seq(plain, T)
    assert plain.generate(Tp + Q, SamplingParams(max_tokens=1)).cached_tokens == s
    # with it: all of T'
    cache_seq(eng, T)
    eng.apply_directives(
        DirectivesRequest(tokens=T, directives=[{"start": s, "end": e, "replacement": R}])
    )
    assert eng.generate(Tp + Q, SamplingParams(max_tokens=1)).cached_tokens == len(Tp)
    r = eng.generate(Tp, SamplingParams(max_tokens=1))
    assert r.cached_tokens == len(Tp) - 1 and r.prefilled_tokens == 1
    st = eng.stats()
    assert st.splices["amortize"] == 1 and st.rotated_tokens == len(T) - e


def test_chain_of_random_directives_matches_reference(arch, ref_model):
    eng = new_engine(arch)
    rng = random.Random(7)
    T = conversation(eng, n_tool=3)
    cache_seq(eng, T)
    ref = RefState.prefill(ref_model, T)
    for step in range(10):
        n = len(T)
        s = rng.randrange(1, n - 1)
        e = min(n, s + rng.randrange(0, 12))
        R = replacement(T, s, rng.randrange(0, 12), seed=100 + step)
        mode = rng.choice(["amortize", "forget"])
        resp = eng.apply_directives(
            DirectivesRequest(
                tokens=T, directives=[{"start": s, "end": e, "replacement": R, "mode": mode}]
            )
        )
        ref = ref.amortize(s, e, R) if mode == "amortize" else ref.forget(s, e, R)
        T = resp.tokens
        assert T == ref.tokens
    assert max_kv_diff(pool_kv(eng, T), ref.kv()) <= 1e-4
    held = {slot for _, slots in eng.cache.tree.sequences() for slot in slots}
    assert eng.allocator.num_used == len(held)  # no slot leaked, none shared by two paths
    assert eng.cache.tree.total_tokens == len(held)
    Q = [11, 12, 13]
    assert (eng.logits_for(T + Q) - logits_from_kv(ref_model, ref.kv(), Q)).abs().max() <= TOL


def test_batch_applies_right_to_left(arch, ref_model):
    eng = new_engine(arch)
    T = conversation(eng)
    cache_seq(eng, T)
    ds = [
        {"start": 5, "end": 9, "replacement": [40, 41], "mode": "amortize"},
        {"start": 30, "end": 31, "replacement": [50, 51, 52], "mode": "forget"},
        {"start": 45, "end": 52, "replacement": [60], "mode": "amortize"},
    ]
    resp = eng.apply_directives(DirectivesRequest(tokens=T, directives=ds))
    ref = RefState.prefill(ref_model, T)
    for d in sorted(ds, key=lambda d: -d["start"]):
        f = ref.amortize if d["mode"] == "amortize" else ref.forget
        ref = f(d["start"], d["end"], d["replacement"])
    assert resp.tokens == ref.tokens
    assert [d.start for d in resp.applied] == [45, 30, 5]
    assert max_kv_diff(pool_kv(eng, resp.tokens), ref.kv()) <= 1e-4


def test_shared_prefix_unchanged_for_other_session(arch):
    eng = new_engine(arch)
    A = conversation(eng)
    B = A[:40] + [101, 102, 103, 104, 105]
    cache_seq(eng, A)
    cache_seq(eng, B)
    mb = eng.cache.tree.match_prefix(B)
    assert mb.length == len(B)
    before = eng.pool.snapshot(mb.slots)
    # splice session A inside the shared part: the tail is copied, never written in place
    eng.apply_directives(
        DirectivesRequest(tokens=A, directives=[{"start": 10, "end": 12, "replacement": [77]}])
    )
    mb2 = eng.cache.tree.match_prefix(B)
    assert mb2.length == len(B) and mb2.slots == mb.slots
    after = eng.pool.snapshot(mb2.slots)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert eng.generate(B + [9], SamplingParams(max_tokens=1)).cached_tokens == len(B)
