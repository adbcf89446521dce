"""Property: random chains of directive batches match the independent reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine, SamplingParams
from leyline_agent.reference.kv_reference import RefState, logits_from_kv
from leyline_agent.wire import DirectivesRequest

_models: dict[str, tuple] = {}


def model_and_tokenizer(arch):
    if arch not in _models:
        d = tiny_model_dir(arch)
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        _models[arch] = (m, AutoTokenizer.from_pretrained(d))
    return _models[arch]


@st.composite
def chains(draw):
    n0 = draw(st.integers(8, 24))
    base = draw(st.lists(st.integers(3, 2000), min_size=n0, max_size=n0))
    steps = []
    n = n0
    for _ in range(draw(st.integers(1, 3))):
        cuts = sorted(draw(st.lists(st.integers(1, n), min_size=2, max_size=4, unique=True)))
        batch = []
        for a, b in zip(cuts[::2], cuts[1::2], strict=False):
            r = draw(st.lists(st.integers(3, 2000), max_size=5))
            batch.append(
                {
                    "start": a,
                    "end": b,
                    "replacement": r,
                    "mode": draw(st.sampled_from(["amortize", "forget"])),
                }
            )
        steps.append(batch)
        n += sum(len(d["replacement"]) - (d["end"] - d["start"]) for d in batch)
    return base, steps


@pytest.mark.parametrize("arch", ["deepseek_v3", "llama"])
def test_random_chains_match_reference(arch):
    model, tok = model_and_tokenizer(arch)

    @settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
    @given(chains())
    def check(case):
        base, steps = case
        eng = Engine(model, tok)
        eng.generate(base, SamplingParams(max_tokens=0))
        ref = RefState.prefill(model, base)
        T = base
        for batch in steps:
            resp = eng.apply_directives(DirectivesRequest(tokens=T, directives=batch))
            for d in resp.applied:  # execution order: right to left
                f = ref.amortize if d.mode == "amortize" else ref.forget
                ref = f(d.start, d.end, d.replacement)
            T = resp.tokens
            assert T == ref.tokens
        q = [5, 6]
        assert eng.generate(T + q, SamplingParams(max_tokens=0)).cached_tokens == len(T)
        got = eng.logits_for(T + q)
        want = logits_from_kv(model, ref.kv(), q)
        assert (got - want).abs().max().item() <= 1e-4

    check()
