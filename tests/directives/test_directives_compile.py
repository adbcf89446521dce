"""Message edits -> token directives: the diff, seams, clipping, and the message form end to end."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from leyline_agent.directives.compile import Span, apply_spans, clip_to_cached, diff_spans
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine, SamplingParams
from leyline_agent.errors import CacheMissError
from leyline_agent.reference.kv_reference import RefState, logits_from_kv
from leyline_agent.wire import DirectivesRequest

B = 0  # message boundary id in the pure tests

seq = st.lists(st.integers(0, 4), max_size=30)


@settings(max_examples=60, deadline=None)
@given(seq, seq)
def test_diff_spans_rebuilds_new_exactly(old, new):
    spans = diff_spans(old, new, boundary=B)
    assert apply_spans(old, spans) == new
    ends = [(s.start, s.end) for s in spans]
    assert all(a[1] < b[0] for a, b in zip(ends, ends[1:], strict=False))  # disjoint, not touching


def test_one_span_per_edited_message_even_when_text_is_shared():
    old = [B, 1, 2, B, 3, 4, 5, 6, 7, B, 8]
    new = [B, 1, 2, B, 3, 9, 5, 9, 7, B, 8]  # one message edited, tokens 5 and 7 shared
    assert diff_spans(old, new, boundary=B) == [Span(5, 8, [9, 5, 9])]
    assert diff_spans(old, new, boundary=None) == [Span(5, 8, [9, 5, 9])]


def test_clip_to_cached():
    spans = [Span(1, 3, [7]), Span(5, 9, [8, 8]), Span(10, 12, [])]
    assert clip_to_cached(spans, 7) == [Span(1, 3, [7]), Span(5, 7, [8, 8])]
    assert clip_to_cached(spans, 5) == [Span(1, 3, [7])]


@pytest.fixture(scope="module")
def eng():
    return Engine.from_pretrained(tiny_model_dir("qwen3"))


@pytest.fixture(scope="module")
def ref_model():
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3"), dtype=torch.float32).eval()


def trajectory():
    return [
        {"role": "system", "content": "You debug Python."},
        {"role": "user", "content": "Fix grader.py"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "view", "arguments": '{"path": "grader.py"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "def grade(x):\n    return x * 2  # wrong\n" * 3},
        {"role": "assistant", "content": "The factor is wrong."},
    ]  # fmt: skip


def test_seam_inside_a_word_is_absorbed(eng):
    """Editing part of a word changes BPE tokens around the edit: the diff still rebuilds it."""
    old = trajectory()
    new = [dict(m) for m in old]
    new[4]["content"] = "The factorial is wrong."
    a = eng.render(old, add_generation_prompt=False)
    b = eng.render(new, add_generation_prompt=False)
    spans = diff_spans(a, b, eng.message_boundary_id)
    assert len(spans) == 1 and apply_spans(a, spans) == b


@pytest.mark.parametrize("mode", ["amortize", "forget"])
def test_message_form_end_to_end(ref_model, mode):
    eng = Engine.from_pretrained(tiny_model_dir("qwen3"))
    old = trajectory()
    tools = [{"type": "function", "function": {"name": "view", "parameters": {"type": "object"}}}]
    T = eng.render(old, tools=tools, add_generation_prompt=False)
    eng.generate(T, SamplingParams(max_tokens=0))
    new = [dict(m) for m in old]
    new[3]["content"] = "[output truncated]"
    new[2]["tool_calls"] = [
        {"id": "c1", "type": "function", "function": {"name": "view", "arguments": "{}"}}
    ]
    resp = eng.apply_directives(
        DirectivesRequest(old_messages=old, new_messages=new, tools=tools, mode=mode)
    )
    Tn = eng.render(new, tools=tools, add_generation_prompt=False)
    assert resp.tokens == Tn
    assert len(resp.applied) == 2 and resp.splices[mode] == 2
    ref = RefState.prefill(ref_model, T)
    for d in resp.applied:  # right to left
        ref = (ref.amortize if mode == "amortize" else ref.forget)(d.start, d.end, d.replacement)
    assert ref.tokens == Tn
    nxt = eng.render(new + [{"role": "user", "content": "go on"}], tools=tools)
    assert nxt[: len(Tn)] == Tn
    r = eng.generate(nxt, SamplingParams(max_tokens=1))
    assert r.cached_tokens == len(Tn)
    got = eng.logits_for(nxt)
    want = logits_from_kv(ref_model, ref.kv(), nxt[len(Tn) :])
    assert (got - want).abs().max().item() <= 1e-4


def test_message_form_span_straddling_the_cached_end(eng, ref_model):
    """Only part of the edited message is cached: without ``fallback`` nothing is applied (a
    miss naming ``old_messages``); with it, T[:start] + R is cached, exactly."""
    old = trajectory()
    T = eng.render(old, add_generation_prompt=False)
    new = [dict(m) for m in old]
    new[4]["content"] = "Something else entirely."
    Tn = eng.render(new, add_generation_prompt=False)
    (span,) = diff_spans(T, Tn, eng.message_boundary_id)
    cached = span.start + 2  # cache T up to two tokens into the edited span
    e2 = Engine.from_pretrained(tiny_model_dir("qwen3"))
    e2.generate(T[:cached], SamplingParams(max_tokens=0))
    with pytest.raises(CacheMissError, match="old_messages"):
        e2.apply_directives(DirectivesRequest(old_messages=old, new_messages=new))
    resp = e2.apply_directives(DirectivesRequest(old_messages=old, new_messages=new, fallback=True))
    assert resp.tokens == Tn
    (d,) = resp.applied
    assert (d.start, d.end) == (span.start, cached)
    keep = span.start + len(span.replacement)
    assert e2.cache.tree.match_prefix(Tn).length == keep
    ref = RefState.prefill(ref_model, Tn[:keep])
    got = e2.logits_for(Tn[: keep + 1])
    want = logits_from_kv(ref_model, ref.kv(), Tn[keep : keep + 1])
    assert (got - want).abs().max().item() <= 1e-4


def test_message_form_edit_beyond_the_cache_is_a_visible_miss(eng):
    """An edit past what is cached executes nothing, and says so: a 409-class miss, or a
    counted fallback (never a silent ``applied: []``)."""
    old = trajectory()
    T = eng.render(old, add_generation_prompt=False)
    e2 = Engine.from_pretrained(tiny_model_dir("qwen3"))
    e2.generate(T[:10], SamplingParams(max_tokens=0))
    new = [dict(m) for m in old]
    new[4]["content"] = "edited"
    before = e2.stats()
    with pytest.raises(CacheMissError, match="old_messages"):
        e2.apply_directives(DirectivesRequest(old_messages=old, new_messages=new))
    assert e2.stats().directive_errors == before.directive_errors + 1
    resp = e2.apply_directives(DirectivesRequest(old_messages=old, new_messages=new, fallback=True))
    assert resp.outcome == "fallback" and resp.fallback and resp.applied == []
    assert resp.tokens == e2.render(new, add_generation_prompt=False)
    assert e2.stats().fallbacks == before.fallbacks + 1
    same = e2.apply_directives(DirectivesRequest(old_messages=old, new_messages=old))
    assert same.outcome == "noop" and same.applied == []
