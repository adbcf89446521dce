"""A directive batch moves each row once (cumulative delta), against the reference applied
one directive at a time (``RefState``: the model's own forwards and rotary functions, never
``rotate_band``), fp32, tiny models. Also: the literal per-directive execution, and that no
slot is shared or leaked when deltas cancel."""

from __future__ import annotations

import random

import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine, SamplingParams
from leyline_agent.engine.executor import apply_request
from leyline_agent.namespaces import DEFAULT_TENANT, Namespace
from leyline_agent.reference.kv_reference import RefState, logits_from_kv
from leyline_agent.wire import DirectivesRequest

ARCHS = ["deepseek_v2", "llama"]
TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


def _reference(ref_model, T, ds):
    ref = RefState.prefill(ref_model, T)
    for d in sorted(ds, key=lambda d: (-d["start"], -d["end"])):
        f = ref.amortize if d["mode"] == "amortize" else ref.forget
        ref = f(d["start"], d["end"], d["replacement"])
    return ref


BATCHES = {
    "five amortizes": [
        {"start": 0, "end": 0, "replacement": [70, 71], "mode": "amortize"},  # insert at 0
        {"start": 6, "end": 10, "replacement": [40], "mode": "amortize"},
        {"start": 14, "end": 14, "replacement": [41, 42, 43], "mode": "amortize"},
        {"start": 30, "end": 33, "replacement": [], "mode": "amortize"},
        {"start": 50, "end": 52, "replacement": [44, 45, 46, 47, 48, 49], "mode": "amortize"},
    ],
    "deltas cancel": [  # the rows between the two directives keep their positions
        {"start": 8, "end": 12, "replacement": [40, 41], "mode": "amortize"},
        {"start": 20, "end": 22, "replacement": [42, 43, 44, 45], "mode": "amortize"},
        {"start": 40, "end": 41, "replacement": [46], "mode": "amortize"},
    ],
    "forget in the middle": [
        {"start": 5, "end": 9, "replacement": [40, 41], "mode": "amortize"},
        {"start": 25, "end": 27, "replacement": [50], "mode": "forget"},
        {"start": 45, "end": 52, "replacement": [60], "mode": "amortize"},
        {"start": 55, "end": 56, "replacement": [61, 62], "mode": "forget"},
    ],
}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("per_directive", [False, True])
def test_batch_equals_reference(arch, ref_model, name, per_directive):
    eng = Engine.from_pretrained(tiny_model_dir(arch))
    rng = random.Random(3)
    T = [rng.randrange(3, 3000) for _ in range(70)]
    eng.generate(T, SamplingParams(max_tokens=0))
    ds = BATCHES[name]
    req = DirectivesRequest(tokens=T, directives=ds)
    ns = Namespace(DEFAULT_TENANT, req.session)
    with eng.stepper.exclusive():
        resp = apply_request(eng, req, ns, per_directive=per_directive)
    ref = _reference(ref_model, T, ds)
    assert resp.tokens == ref.tokens
    m = eng.cache.tree.match_prefix(resp.tokens, ns)
    assert m.length == len(resp.tokens)
    got = eng.pool.as_cache_data(m.slots)
    diff = max(
        (x - y).abs().max().item()
        for p, q in zip(got, ref.kv(), strict=True)
        for x, y in zip(p, q, strict=True)
    )
    assert diff <= TOL
    eng.cache.check()  # every slot cached once or free: nothing shared, nothing leaked
    Q = [11, 12, 13]
    want = logits_from_kv(ref_model, ref.kv(), Q)
    assert (eng.logits_for(resp.tokens + Q, namespace=ns) - want).abs().max().item() <= TOL


def test_each_row_is_rotated_once(arch):
    eng = Engine.from_pretrained(tiny_model_dir(arch))
    T = list(range(100, 170))
    eng.generate(T, SamplingParams(max_tokens=0))
    ds = BATCHES["five amortizes"]
    resp = eng.apply_directives(DirectivesRequest(tokens=T, directives=ds))
    # moved: every base row after the first directive (insert at 0: all 70 minus the 4 + 3
    # replaced), plus the R rows that a directive to their left shifted (all but the first)
    moved_base = len(T) - sum(d["end"] - d["start"] for d in ds)
    moved_r = sum(len(d["replacement"]) for d in ds[1:])
    assert resp.rotated_tokens == moved_base + moved_r
    assert resp.prefilled_tokens == sum(len(d["replacement"]) for d in ds)
