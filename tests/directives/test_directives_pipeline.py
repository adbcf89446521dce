"""``directives.pipeline``: compile a request, then decide from the cached length of its base.

Every backend (the embedded engine, the vLLM and SGLang plugins) answers through these two
functions, so what is checked here is what all of them answer: the right-to-left order and
``T'`` of a token-form batch, the spans of a message-form edit, the one miss message per
form, the fallback answer, the noop, and which part of an edit a cached prefix keeps.
Expectations are written out by hand (positions in the rendered conversation, the spliced
sequence), not computed by the code under test.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from leyline_agent.directives import Directive, Mode
from leyline_agent.directives.compile import Span
from leyline_agent.directives.pipeline import (
    MessageForm,
    Plan,
    TokenForm,
    applied_answer,
    compile_request,
    decide,
)
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.errors import CacheMissError, DirectiveError, InvalidRequestError
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

BOUNDARY = 1  # <|im_start|>: opens every message of the tiny llama's ChatML template
VOCAB = 6002

OLD = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "tool", "content": "long output here"},
]
# rendered: <|im_start|> system \n Be brief . <|im_end|> \n   -> positions 0-10
#           <|im_start|> user \n hi <|im_end|> \n              -> 11-16 ("hi" at 14)
#           <|im_start|> tool \n long output here <|im_end|> \n -> 17-24 (content at 20-22)
OLD_LEN = 25


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


def _ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _edited(**contents: str) -> list[dict]:
    """OLD with the messages at the given indices (``m1``, ``m2``) given new contents."""
    new = [dict(m) for m in OLD]
    for key, content in contents.items():
        new[int(key[1:])]["content"] = content
    return new


# -- token form ------------------------------------------------------------------------------

T = list(range(10, 30))  # 20 tokens


def _token_req(directives, **kw) -> DirectivesRequest:
    return DirectivesRequest(tokens=T, directives=directives, **kw)


def test_token_form_compiles_right_to_left_with_text_encoded(tok) -> None:
    stub = _ids(tok, "[stub]")
    assert stub == [61, 281, 524, 63]
    req = _token_req([Directive(start=2, end=4, replacement=[7]),
                      Directive(start=10, end=12, replacement="[stub]")])  # fmt: skip
    c = compile_request(req, tok, VOCAB, BOUNDARY)
    assert isinstance(c, TokenForm) and c.needs_lookup
    assert c.base == T
    assert [(d.start, d.end, d.replacement) for d in c.directives] == [(2, 4, [7]), (10, 12, stub)]
    assert [(d.start, d.end) for d in c.order] == [(10, 12), (2, 4)]  # right to left
    assert c.new_tokens == [10, 11, 7, 14, 15, 16, 17, 18, 19, *stub, *range(22, 30)]


def test_token_form_refuses_bad_ids_and_overlaps_before_any_lookup(tok) -> None:
    with pytest.raises(InvalidRequestError) as e:
        compile_request(DirectivesRequest(tokens=[5, VOCAB], directives=[]), tok, VOCAB, BOUNDARY)
    assert e.value.field == "tokens[1]"
    overlap = [
        Directive(start=2, end=6, replacement=[1]),
        Directive(start=5, end=8, replacement=[]),
    ]
    with pytest.raises(DirectiveError, match=r"directives\[1\]: span \[5, 8\) overlaps"):
        compile_request(_token_req(overlap), tok, VOCAB, BOUNDARY)
    with pytest.raises(DirectiveError, match=r"directives\[0\]\.end: 21 is past the end"):
        compile_request(_token_req([Directive(start=3, end=21, replacement=[])]), tok, VOCAB, 1)


def test_token_form_plans_on_the_cached_prefix_only(tok) -> None:
    req = _token_req([Directive(start=2, end=4, replacement=[7]),
                      Directive(start=10, end=12, replacement=[8, 9])])  # fmt: skip
    c = compile_request(req, tok, VOCAB, BOUNDARY)
    new = [10, 11, 7, *range(14, 20), 8, 9, *range(22, 30)]
    plan = decide(c, 15, req)
    assert plan == Plan(base=T[:15], order=c.order, new_tokens=new, cached=15)
    assert decide(c, 12, req).base == T[:12]  # the last span ends exactly at the cached end
    assert decide(c, 99, req) == Plan(T, c.order, new, 20)  # clamped to the base


@pytest.mark.parametrize(
    ("cached", "named"),
    [
        (11, "directives[1]: span [10, 12)"),
        (3, "directives[0]: span [2, 4)"),
        (0, "directives[0]: span [2, 4)"),
    ],  # fmt: skip
)
def test_token_form_miss_names_the_first_uncached_span(tok, cached, named) -> None:
    req = _token_req([Directive(start=2, end=4, replacement=[7]),
                      Directive(start=10, end=12, replacement=[8, 9])])  # fmt: skip
    c = compile_request(req, tok, VOCAB, BOUNDARY)
    with pytest.raises(CacheMissError) as e:
        decide(c, cached, req)
    assert str(e.value) == (
        f"{named} of 'tokens' is not cached "
        f"(the prefix cache holds its first {cached} of 20 tokens)"
    )
    fb = decide(c, cached, req.model_copy(update={"fallback": True}))
    assert fb == DirectivesResponse(
        outcome="fallback",
        tokens=[10, 11, 7, *range(14, 20), 8, 9, *range(22, 30)],
        applied=c.order,
        fallback=True,
    )
    assert fb.splices == {} and fb.cached_base_tokens == 0


def test_token_form_without_directives_is_a_noop_over_the_cached_prefix(tok) -> None:
    req = _token_req([])
    c = compile_request(req, tok, VOCAB, BOUNDARY)
    assert c.needs_lookup  # the answer says how much is cached
    out = decide(c, 7, req)
    assert isinstance(out, DirectivesResponse)
    assert (out.outcome, out.tokens, out.applied) == ("noop", T, [])
    assert (out.cached_base_tokens, out.reused_tokens) == (7, 7)
    assert out.splices == {"amortize": 0, "forget": 0}


# -- message form ----------------------------------------------------------------------------


def _message_req(new, **kw) -> DirectivesRequest:
    return DirectivesRequest(old_messages=OLD, new_messages=new, **kw)


def test_message_form_diffs_one_span_per_edited_message(tok) -> None:
    x, hello = _ids(tok, "[x]"), _ids(tok, "hello there")
    c = compile_request(_message_req(_edited(m1="hello there", m2="[x]")), tok, VOCAB, BOUNDARY)
    assert isinstance(c, MessageForm) and c.needs_lookup
    assert len(c.base) == OLD_LEN and c.base[14] == _ids(tok, "hi")[0]
    assert c.spans == [Span(14, 15, hello), Span(20, 23, x)]
    assert c.new_tokens == c.base[:14] + hello + c.base[15:20] + x + c.base[23:]


def test_message_form_fully_cached_is_a_plan_of_every_span(tok) -> None:
    x = _ids(tok, "[x]")
    req = _message_req(_edited(m2="[x]"), mode="forget")
    c = compile_request(req, tok, VOCAB, BOUNDARY)
    plan = decide(c, OLD_LEN, req)
    assert isinstance(plan, Plan)
    assert plan.base == c.base and plan.cached == OLD_LEN
    assert plan.order == [Directive(start=20, end=23, replacement=x, mode=Mode.FORGET)]
    assert plan.new_tokens == c.base[:20] + x + c.base[23:]


def test_message_form_partial_clip_is_a_miss_without_fallback(tok) -> None:
    x = _ids(tok, "[x]")
    req = _message_req(_edited(m2="[x]"))
    c = compile_request(req, tok, VOCAB, BOUNDARY)
    with pytest.raises(CacheMissError) as e:
        decide(c, 22, req)  # the span [20, 23) straddles the cached end
    assert str(e.value) == (
        "old_messages: the edits span tokens [20, 23) of the rendered conversation but only "
        "its first 22 tokens are cached (without fallback no edit is applied in part)"
    )
    plan = decide(c, 22, req.model_copy(update={"fallback": True}))
    assert plan == Plan(
        base=c.base[:22],
        order=[Directive(start=20, end=22, replacement=x)],  # clipped: (start, cached, R)
        new_tokens=c.new_tokens,
        cached=22,
    )


def test_message_form_keeps_the_cached_edits_only_with_fallback(tok) -> None:
    hello = _ids(tok, "hello there")
    req = _message_req(_edited(m1="hello there", m2="[x]"))
    c = compile_request(req, tok, VOCAB, BOUNDARY)
    with pytest.raises(CacheMissError, match=r"span tokens \[14, 23\).* first 18 tokens"):
        decide(c, 18, req)
    plan = decide(c, 18, req.model_copy(update={"fallback": True}))
    assert isinstance(plan, Plan) and plan.base == c.base[:18]
    assert plan.order == [Directive(start=14, end=15, replacement=hello)]  # the tool edit dropped


@pytest.mark.parametrize("cached", [0, 20])  # nothing cached / the span starts at the end
def test_message_form_nothing_kept_is_a_miss_even_with_fallback(tok, cached) -> None:
    req = _message_req(_edited(m2="[x]"))
    c = compile_request(req, tok, VOCAB, BOUNDARY)
    with pytest.raises(CacheMissError, match=f"only its first {cached} tokens"):
        decide(c, cached, req)
    fb = decide(c, cached, req.model_copy(update={"fallback": True}))
    assert fb == DirectivesResponse(
        outcome="fallback", tokens=c.new_tokens, applied=[], fallback=True
    )


def test_message_form_without_changes_is_a_noop_whatever_is_cached(tok) -> None:
    req = _message_req([dict(m) for m in OLD])
    c = compile_request(req, tok, VOCAB, BOUNDARY)
    assert c.spans == [] and not c.needs_lookup
    for cached in (0, 10, OLD_LEN):
        out = decide(c, cached, req)
        assert isinstance(out, DirectivesResponse)
        assert (out.outcome, out.tokens, out.applied, out.fallback) == ("noop", c.base, [], False)
        assert (out.cached_base_tokens, out.reused_tokens) == (0, OLD_LEN)


def test_applied_answer_reports_the_plan_and_the_backend_counts() -> None:
    d = Directive(start=1, end=2, replacement=[5, 6])
    plan = Plan(base=[1, 2, 3], order=[d], new_tokens=[1, 5, 6, 3, 4], cached=3)
    out = applied_answer(plan, splices={"amortize": 1, "forget": 0}, reused=2, prefilled=2,
                         rotated=1)  # fmt: skip
    assert (out.outcome, out.tokens, out.applied, out.cached_base_tokens) == (
        "applied", [1, 5, 6, 3, 4], [d], 3,
    )  # fmt: skip
    assert (out.reused_tokens, out.prefilled_tokens, out.rotated_tokens) == (2, 2, 1)
    assert out.splices == {"amortize": 1, "forget": 0} and not out.fallback


def test_token_form_insertion_at_zero_needs_something_cached(tok) -> None:
    req = _token_req([Directive(start=0, end=0, replacement=[7])])
    c = compile_request(req, tok, VOCAB, BOUNDARY)
    with pytest.raises(CacheMissError, match=r"^directives\[0\]: span \[0, 0\) .* first 0 of 20"):
        decide(c, 0, req)
    assert decide(c, 1, req) == Plan([10], c.order, [7, *T], 1)
