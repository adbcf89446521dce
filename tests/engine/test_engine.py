"""Engine.generate and bad-input handling on a tiny model (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine, SamplingParams
from leyline_agent.errors import CacheMissError, LeylineError, TrajectoryError
from leyline_agent.wire import DirectivesRequest

ARCH = "deepseek_v2"


@pytest.fixture(scope="module")
def eng():
    return Engine.from_pretrained(tiny_model_dir(ARCH))


@pytest.fixture(scope="module")
def ref_model():
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(ARCH), dtype=torch.float32).eval()


@torch.inference_mode()
def greedy_no_cache(model, ids, n):
    """Independent: full forward of the whole sequence at every step, no cache at all."""
    ids, out = list(ids), []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        t = int(torch.argmax(logits))
        out.append(t)
        ids.append(t)
    return out


def prompt(eng, text="Why does test_counter fail?"):
    return eng.render([{"role": "user", "content": text}])


def test_greedy_matches_uncached_forward_and_caches_prompt_plus_output(eng, ref_model):
    ids = prompt(eng)
    r = eng.generate(ids, SamplingParams(max_tokens=12, stop_token_ids=[]))
    assert r.output_ids == greedy_no_cache(ref_model, ids, len(r.output_ids))
    assert r.prompt_tokens == len(ids) and r.cached_tokens + r.prefilled_tokens == len(ids)
    # the whole of prompt + output is cached, so the next turn hits all of it
    nxt = r.prompt_ids + r.output_ids + prompt(eng, "and then?")
    r2 = eng.generate(nxt, SamplingParams(max_tokens=4))
    assert r2.cached_tokens == len(r.prompt_ids) + len(r.output_ids)
    assert r2.output_ids == greedy_no_cache(ref_model, nxt, len(r2.output_ids))


def test_logprobs_and_streaming_deltas(eng, ref_model):
    ids = prompt(eng, "logprobs please")
    seen = []
    r = eng.generate(
        ids,
        SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3, stop_token_ids=[]),
        on_token=lambda t, s: seen.append((t, s)),
    )
    assert [t for t, _ in seen] == r.output_ids
    assert "".join(s for _, s in seen) == r.text
    with torch.inference_mode():
        logits = ref_model(input_ids=torch.tensor([ids])).logits[0, -1]
    lp = torch.log_softmax(logits.float(), -1)
    first = r.logprobs[0]
    assert first.token_id == r.output_ids[0]
    assert abs(first.logprob - lp[first.token_id].item()) < 1e-4
    assert [t for t, _, _ in first.top] == torch.topk(lp, 3).indices.tolist()


def test_stop_string_truncates_text(eng):
    ids = prompt(eng, "stop strings")
    free = eng.generate(ids, SamplingParams(max_tokens=10, stop_token_ids=[]))
    assert len(free.text) > 4
    stop = free.text[2:4]
    r = eng.generate(ids, SamplingParams(max_tokens=10, stop=[stop], stop_token_ids=[]))
    assert r.finish_reason == "stop"
    assert r.text == free.text[: free.text.find(stop)]


def test_max_tokens_and_eos(eng):
    ids = prompt(eng, "short")
    r = eng.generate(ids, SamplingParams(max_tokens=3, stop_token_ids=[]))
    assert len(r.output_ids) == 3 and r.finish_reason in ("length", "stop")
    first = r.output_ids[0]
    r2 = eng.generate(ids, SamplingParams(max_tokens=5, stop_token_ids=[first]))
    assert r2.output_ids == [first] and r2.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(eng):
    ids = prompt(eng, "sample")
    p = SamplingParams(max_tokens=8, temperature=1.5, top_p=0.9, seed=3, stop_token_ids=[])
    a, b = eng.generate(ids, p), eng.generate(ids, p)
    assert a.output_ids == b.output_ids
    c = eng.generate(ids, SamplingParams(max_tokens=8, temperature=1.5, seed=4, stop_token_ids=[]))
    assert c.output_ids != a.output_ids


def test_no_prefix_cache_reports_nothing_cached():
    e = Engine.from_pretrained(tiny_model_dir(ARCH), prefix_cache=False)
    ids = prompt(e)
    e.generate(ids, SamplingParams(max_tokens=2))
    assert e.generate(ids, SamplingParams(max_tokens=2)).cached_tokens == 0
    with pytest.raises(CacheMissError):
        e.apply_directives(DirectivesRequest(tokens=ids, directives=[{"start": 1, "end": 2}]))


def _snapshot(e: Engine):
    return (
        e.stats().model_dump(),
        e.cache.tree.sequences(),
        [(n.last_access, n.lock_ref) for n in e.cache.tree._nodes()],
        e.pool.keys.clone(),
        e.pool.values.clone(),
        list(e.allocator._free),
    )


def _same(a, b, ignore_directive_errors=False):
    sa, sb = dict(a[0]), dict(b[0])
    if ignore_directive_errors:
        sa.pop("directive_errors"), sb.pop("directive_errors")
    return (
        sa == sb
        and a[1] == b[1]
        and a[2] == b[2]
        and torch.equal(a[3], b[3])
        and torch.equal(a[4], b[4])
        and a[5] == b[5]
    )


BAD_TOKEN_FORM = [
    ("tokens", lambda T: dict(tokens=[], directives=[])),
    ("tokens[2]", lambda T: dict(tokens=T[:2] + [10**7] + T[3:], directives=[])),
    ("directives[0].replacement[1]", lambda T: dict(tokens=T, directives=[{"start": 1, "end": 2, "replacement": [5, -0 + 10**7]}])),
    ("overlaps", lambda T: dict(tokens=T, directives=[{"start": 1, "end": 5}, {"start": 3, "end": 8}])),
    ("past the end", lambda T: dict(tokens=T, directives=[{"start": 1, "end": len(T) + 1}])),
    ("ambiguous", lambda T: dict(tokens=T, directives=[{"start": 4, "end": 4, "replacement": [1]}, {"start": 4, "end": 4, "replacement": [2]}])),
]  # fmt: skip


@pytest.mark.parametrize("needle,make", BAD_TOKEN_FORM, ids=[b[0] for b in BAD_TOKEN_FORM])
def test_bad_token_form_leaves_everything_unchanged(eng, needle, make):
    T = prompt(eng, "bad inputs")
    eng.generate(T, SamplingParams(max_tokens=0))
    before = _snapshot(eng)
    with pytest.raises(LeylineError, match="directive|tokens|overlap|past the end|replacement"):
        eng.apply_directives(DirectivesRequest(**make(T)))
    assert _same(before, _snapshot(eng))


def test_cache_miss_is_counted_and_changes_nothing_else(eng):
    T = prompt(eng, "miss")
    eng.generate(T, SamplingParams(max_tokens=0))
    other = [7, 8, 9] + T  # differs at token 0: nothing of it is cached
    before = _snapshot(eng)
    with pytest.raises(CacheMissError, match=r"directives\[0\]"):
        eng.apply_directives(DirectivesRequest(tokens=other, directives=[{"start": 4, "end": 6}]))
    after = _snapshot(eng)
    assert _same(before, after, ignore_directive_errors=True)
    assert after[0]["directive_errors"] == before[0]["directive_errors"] + 1
    r = eng.apply_directives(
        DirectivesRequest(tokens=other, directives=[{"start": 4, "end": 6}], fallback=True)
    )
    assert r.fallback and r.tokens == other[:4] + other[6:]
    assert eng.stats().fallbacks == before[0]["fallbacks"] + 1


def test_bad_message_form_and_bad_generate_inputs(eng):
    before = _snapshot(eng)
    with pytest.raises(TrajectoryError, match=r"old_messages\[1\]\.role"):
        eng.apply_directives(
            DirectivesRequest(
                old_messages=[{"role": "user", "content": "a"}, {"content": "b"}],
                new_messages=[{"role": "user", "content": "a"}],
            )
        )
    with pytest.raises(TrajectoryError, match=r"new_messages\[0\]\.content"):
        eng.apply_directives(
            DirectivesRequest(
                old_messages=[{"role": "user", "content": "a"}],
                new_messages=[{"role": "user", "content": 3}],
            )
        )
    with pytest.raises(LeylineError, match=r"prompt_ids\[1\]"):
        eng.generate([1, 10**7])
    with pytest.raises(LeylineError, match="top_p"):
        eng.generate([1, 2], SamplingParams(top_p=0))
    with pytest.raises(LeylineError, match="prompt_ids"):
        eng.generate([])
    with pytest.raises(LeylineError, match="max_tokens.*context"):
        eng.generate([1, 2], SamplingParams(max_tokens=eng.config.max_position_embeddings))
    assert _same(before, _snapshot(eng))


def test_text_replacement_is_tokenized(eng):
    T = prompt(eng, "text replacement")
    eng.generate(T, SamplingParams(max_tokens=0))
    r = eng.apply_directives(
        DirectivesRequest(tokens=T, directives=[{"start": 3, "end": 5, "replacement": "[stub]"}])
    )
    ids = eng.tokenizer.encode("[stub]", add_special_tokens=False)
    assert r.tokens == T[:3] + ids + T[5:]
    assert isinstance(r.applied[0].replacement, list)
