"""The wire contracts: Directive validation, batch planning, and the pure T' computation."""

from __future__ import annotations

import json
import random

import pytest

from leyline_agent import Directive, DirectiveError, MessageEdit, Mode, UnsupportedModeError
from leyline_agent.directives import plan_batch, splice_tokens
from leyline_agent.wire import DirectivesRequest


def _splice_left_to_right(tokens, spans):
    """Independent construction: walk the sequence once, left to right."""
    out, pos = [], 0
    for start, end, rep in sorted(spans):
        out += tokens[pos:start] + rep
        pos = end
    return out + tokens[pos:]


def test_default_mode_is_amortize_and_delta():
    d = Directive(start=3, end=7, replacement=[1, 2])
    assert d.mode is Mode.AMORTIZE
    assert d.delta == 2 - 4
    assert Directive(start=5, end=5, replacement=[9, 9, 9]).delta == 3


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"start": -1, "end": 2}, "start"),
        ({"start": 4, "end": 2}, "start (4) must be <= end (2)"),
        ({"start": 0, "end": 2, "replacement": [1, -5]}, "replacement[1]"),
        ({"start": 0, "end": 2, "mode": "erase"}, "mode"),
        ({"start": 0, "end": 2, "bogus": 1}, "bogus"),
        ({"start": "x", "end": 2}, "start"),
    ],
)
def test_bad_directive_names_the_field(data, field):
    with pytest.raises(DirectiveError) as e:
        Directive.parse(data, where="directives[3]")
    assert "directives[3]" in str(e.value)
    assert field in str(e.value)


@pytest.mark.parametrize("mode", ["pin", "decay", "scratch"])
def test_reserved_modes_are_rejected(mode):
    with pytest.raises(UnsupportedModeError, match="reserved"):
        Directive.parse({"start": 0, "end": 1, "mode": mode})


def test_text_replacement_needs_compiling():
    d = Directive(start=0, end=1, replacement="stub")
    assert not d.is_compiled
    with pytest.raises(DirectiveError, match="replacement"):
        _ = d.delta
    with pytest.raises(DirectiveError, match="compiled"):
        splice_tokens([1, 2, 3], [d])


def test_plan_batch_is_right_to_left_and_rejects_overlap():
    ds = [
        Directive(start=0, end=2),
        Directive(start=10, end=12),
        Directive(start=4, end=4, replacement=[7]),
    ]
    assert [d.start for d in plan_batch(ds)] == [10, 4, 0]
    with pytest.raises(DirectiveError, match=r"directives\[1\].*overlaps directives\[0\]"):
        plan_batch([Directive(start=2, end=6), Directive(start=5, end=8)])
    with pytest.raises(DirectiveError, match="overlaps"):
        plan_batch(
            [Directive(start=3, end=3, replacement=[1]), Directive(start=3, end=3, replacement=[2])]
        )
    with pytest.raises(DirectiveError, match=r"directives\[0\].end: 9 is past the end"):
        plan_batch([Directive(start=1, end=9)], seq_len=8)


def test_splice_tokens_matches_left_to_right_construction():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randrange(0, 40)
        tokens = [rng.randrange(1000) for _ in range(n)]
        cuts = sorted(rng.sample(range(n + 1), k=min(n + 1, 2 * rng.randrange(0, 4))))
        spans = []
        for a, b in zip(cuts[::2], cuts[1::2], strict=False):
            spans.append((a, b, [rng.randrange(1000) for _ in range(rng.randrange(0, 6))]))
        ds = [Directive(start=a, end=b, replacement=r) for a, b, r in spans]
        rng.shuffle(ds)
        before = list(tokens)
        assert splice_tokens(tokens, ds) == _splice_left_to_right(tokens, spans)
        assert tokens == before  # input never modified


def test_message_edit_needs_a_change():
    with pytest.raises(ValueError, match="content or tool_calls"):
        MessageEdit(index=1, policy="stale-tool")
    e = MessageEdit(index=1, content="[stub]", policy="stale-tool")
    assert MessageEdit.model_validate_json(e.model_dump_json()) == e


def test_directives_request_forms():
    tok = DirectivesRequest(tokens=[1, 2, 3], directives=[{"start": 0, "end": 1}])
    assert tok.directives[0].mode is Mode.AMORTIZE
    msg = DirectivesRequest(
        old_messages=[{"role": "user", "content": "a"}],
        new_messages=[{"role": "user", "content": "b"}],
    )
    assert json.loads(msg.model_dump_json())["mode"] == "amortize"
    for bad in (
        {},
        {"tokens": [1]},
        {"old_messages": []},
        {"tokens": [1], "directives": [], "old_messages": [], "new_messages": []},
    ):
        with pytest.raises(ValueError):
            DirectivesRequest.model_validate(bad)


def test_apply_directives_at_the_top_level_is_a_deprecated_name_of_splice_tokens():
    """One name, one idea: ``apply_directives`` executes a request on a cache (engines,
    runtimes); the pure ``T'`` is ``splice_tokens``, and the old top-level name warns."""
    import leyline_agent

    assert "apply_directives" not in leyline_agent.__all__
    with pytest.warns(DeprecationWarning, match="splice_tokens"):
        old = leyline_agent.apply_directives
    assert old is leyline_agent.splice_tokens
