"""``text_match``: the linear scanners agree with Python's backtracking ``re`` (the reference)
on small random texts, and client patterns that backtrack are refused or run linearly.
"""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leyline_agent.text_match import compile_pattern, cut_spans, fills_template, has_span

_PIECES = st.lists(st.sampled_from(["<think>", "</think>", "a", " ", "\n", "<", "b>"]), max_size=12)
THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


@settings(max_examples=200, deadline=None)
@given(_PIECES)
def test_cut_spans_is_the_lazy_regex(parts):
    text = "".join(parts)
    assert cut_spans(text, "<think>", "</think>") == THINK.sub("", text)
    assert has_span(text, "<think>", "</think>") == (THINK.search(text) is not None)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["{tool}", "{error}", "x", "ab", ":", " "]), min_size=1, max_size=6),
    st.lists(st.sampled_from(["x", "ab", ":", " ", "{tool}", "b"]), max_size=8),
)
def test_fills_template_is_the_wildcard_regex(template_parts, text_parts):
    template, text = "".join(template_parts), "".join(text_parts)
    ref = re.escape(template)
    for hole in ("{tool}", "{error}"):
        ref = ref.replace(re.escape(hole), ".*")
    expected = re.fullmatch(ref, text, re.DOTALL) is not None
    assert fills_template(text, template, ("{tool}", "{error}")) == expected


@pytest.mark.timing
def test_unclosed_tags_and_many_holes_are_linear():
    t0 = time.monotonic()
    text = "<think>" * 40_000
    assert cut_spans(text, "<think>", "</think>") == text
    assert not fills_template("x" * 100_000 + "?", "{tool}" * 10 + "!", ("{tool}",))
    assert time.monotonic() - t0 < 1.0


@pytest.mark.timing
def test_a_nested_quantifier_runs_in_linear_time():
    p = compile_pattern(r"(a+)+$", multiline=True)
    t0 = time.monotonic()
    assert p.search("a" * 40 + "!") is None
    assert p.search("x\n" + "a" * 40) is not None  # $ at the end of a line
    assert time.monotonic() - t0 < 0.5


@pytest.mark.parametrize("pattern", [r"(a)\1", r"(?<=a)b", r"(?=a)", "(a{1000}){1000}", "x" * 1001])
def test_backtracking_features_are_refused(pattern):
    with pytest.raises(ValueError):
        compile_pattern(pattern)
