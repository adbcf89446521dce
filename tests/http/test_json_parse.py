"""``http.json_parse.loads`` against the standard library's ``json.loads``, the ground truth.

Both of its paths (``json.loads`` under ``C_PARSE_VALUES`` separators, the counting
pure-Python scanner above) give ``json.loads``'s values and errors; the scanner refuses a body
past ``max_values`` values, and a body of mostly long strings stays on the fast path whatever
its size.
"""

from __future__ import annotations

import json

import pytest

from leyline_agent.http.json_parse import C_PARSE_VALUES, TooManyValuesError, loads


def _chat(n: int) -> bytes:
    turns = [{"role": "user", "content": f"m{k} \u00e9\ud83d\ude00"} for k in range(n)]
    return json.dumps({"model": "x", "messages": turns, "nums": [1.5, -2, None, True]}).encode()


@pytest.mark.parametrize("n", [10, C_PARSE_VALUES // 3 + 10])  # fast path, then the scanner
def test_both_paths_give_json_loads_values(n):
    raw = _chat(n)
    assert loads(raw) == json.loads(raw)
    assert loads(raw.decode()) == json.loads(raw)


def test_the_scanner_stops_past_the_limit_and_counts_nested_values():
    raw = json.dumps({"x": [[1, 2]] * (C_PARSE_VALUES // 2)}).encode()
    with pytest.raises(TooManyValuesError):
        loads(raw, max_values=C_PARSE_VALUES)
    assert loads(raw, max_values=3 * C_PARSE_VALUES // 2 + 2) == json.loads(raw)


@pytest.mark.parametrize("bad", [b'{"a": [1, 2,]}', b'{"a": NaN', b"\xff"])
def test_errors_are_json_loads_errors(bad):
    body = bad + b"," * C_PARSE_VALUES  # the scanner's path
    with pytest.raises(ValueError) as theirs:
        json.loads(body)
    with pytest.raises(type(theirs.value)):
        loads(body)
