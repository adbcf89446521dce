"""REPAIR's row selection (pure), against selections written out by hand."""

from __future__ import annotations

import pytest

from leyline_agent.directives.modes import rule_of
from leyline_agent.directives.repair import SELECTORS, RepairSpan, match_runs, rows_for, select_rows
from leyline_agent.errors import UnsupportedModeError


def test_rows_for_budget_bounds():
    assert [rows_for(b, 200) for b in (0.0, 0.001, 0.02, 0.5, 1.0)] == [0, 1, 4, 100, 200]
    with pytest.raises(ValueError, match="budget"):
        rows_for(1.5, 10)


def test_selectors_pick_the_quote_and_its_continuation():
    # tail T'[10:40]; the removed span held (5, 6, 7, 8); the tail quotes (5, 6) at 15-16
    # and (7, 8) at 30-31
    t = list(range(100, 140))
    t[15], t[16], t[30], t[31] = 5, 6, 7, 8
    span = RepairSpan(10, 40, (5, 6, 7, 8), 0.2)  # ceil(0.2 * 30) = 6 rows
    assert select_rows(t, [span], "ngram") == [15, 16, 17, 30, 31, 32]
    assert select_rows(t, [span], "ngram-first") == [10, 11, 15, 16, 30, 31]
    assert select_rows(t, [span], "first") == [10, 11, 12, 13, 14, 15]
    assert select_rows(t, [span], "first+ngram") == [10, 11, 12, 15, 16, 30]
    no_match = RepairSpan(10, 40, (1, 2, 3), 0.1)
    assert select_rows(t, [no_match], "ngram") == [10, 11, 12]
    with pytest.raises(ValueError, match="selector"):
        select_rows(t, [span], "nope")


def test_match_ranks_long_quotes_above_coincidences():
    # tail T'[10:50]; the removed span held (1, 2, 3, 4, 5, 6, 6); the tail has two
    # coincidental pairs, (6, 6) at 12-13 and (4, 5) at 20-21, and quotes (2, 3, 4, 5, 6)
    # at 40-44 (runs written out by hand, longest first)
    span_tokens = (1, 2, 3, 4, 5, 6, 6)
    t = list(range(100, 150))
    t[12], t[13] = 6, 6
    t[20], t[21] = 4, 5
    t[40:45] = [2, 3, 4, 5, 6]
    span = RepairSpan(10, 50, span_tokens, 0.15)  # ceil(0.15 * 40) = 6 rows
    assert match_runs(t, span) == [(40, 5), (12, 2), (20, 2)]
    # the quote and the row after it; ngram takes the rows by position instead
    assert select_rows(t, [span], "match") == [40, 41, 42, 43, 44, 45]
    assert select_rows(t, [span], "ngram") == [12, 13, 20, 21, 40, 41]
    # a quarter (one row) right after the splice, then the quote
    assert select_rows(t, [span], "match-first") == [10, 40, 41, 42, 43, 44]
    # three rows of the longest quote, then ngram's by position
    assert select_rows(t, [span], "match+ngram") == [12, 13, 20, 40, 41, 42]
    whole = RepairSpan(10, 50, span_tokens, 1.0)
    for sel in SELECTORS:
        assert select_rows(t, [whole], sel) == list(range(10, 50)), sel


def test_a_mode_a_backend_does_not_execute_is_refused_by_name():
    with pytest.raises(UnsupportedModeError, match=r"directives\[0\].mode: 'repair'"):
        rule_of("repair", {rule_of("amortize").mode}, where="directives[0].mode")
    with pytest.raises(UnsupportedModeError, match="reserved"):
        rule_of("pin")


def test_the_pipeline_refuses_repair_for_a_backend_without_it():
    """What a backend without the ``recompute`` row operation passes (the SGLang plugin:
    amortize and forget): a REPAIR directive is refused by name before any lookup, in either
    form."""
    from leyline_agent.directives import Mode
    from leyline_agent.directives.pipeline import compile_request
    from leyline_agent.wire import DirectivesRequest

    plugins = frozenset({Mode.AMORTIZE, Mode.FORGET})
    req = DirectivesRequest(
        tokens=[5, 6, 7, 8],
        directives=[{"start": 1, "end": 2, "replacement": [9], "mode": "repair"}],
    )
    with pytest.raises(UnsupportedModeError, match=r"directives\[0\]\.mode: 'repair'"):
        compile_request(req, None, 100, None, plugins)
    msgs = [{"role": "user", "content": "hi"}]
    req = DirectivesRequest(old_messages=msgs, new_messages=msgs, mode="repair")
    with pytest.raises(UnsupportedModeError, match=r"^mode: 'repair'"):
        compile_request(req, None, 100, None, plugins)
