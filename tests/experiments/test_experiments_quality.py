"""``leyline check quality``'s conversations and cases (no model run: the report's numbers come
from ``leyline check quality`` itself, recorded in docs/results.md).

- the kept conversations are what the generator makes from real command output today;
- there are >= 30 general conversations and 12 fact cases (3 quoted right after the stub,
  3 quoted two turns later, 6 only inside the stubbed span), and a span-only number appears
  nowhere but in the stubbed output;
- each case's edit, applied to ``T``, gives exactly the tokens of the edited conversation
  rendered on its own, and its question follows ``T`` as the template renders it.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from transformers import AutoTokenizer

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.experiments.check.quality import build_cases
from leyline_agent.experiments.check.quality_data import generate, load_conversations

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def convs():
    return load_conversations()


def test_the_kept_conversations_are_what_the_commands_print(convs):
    assert generate() == convs


def test_enough_conversations_and_fact_cases(convs):
    kinds = Counter(c["kind"] for c in convs)
    assert kinds["general"] >= 30
    assert kinds == {"general": kinds["general"], "quoted_next": 3, "quoted_later": 3, "span_only": 6}
    for c in convs:
        assert c["messages"][c["stale"]]["role"] == "tool"
        if c["kind"] == "general":
            continue
        n = c["answer"]
        where = [i for i, m in enumerate(c["messages"]) if n in re.findall(r"\d+", m["content"])]
        quoted = [i for i in where if c["messages"][i]["role"] == "assistant"]
        if c["kind"] == "span_only":
            assert where == [c["stale"]], c["id"]
        else:
            after = 1 if c["kind"] == "quoted_next" else 3  # assistant turns after the stub
            turns = [i for i, m in enumerate(c["messages"]) if m["role"] == "assistant" and i > c["stale"]]
            assert quoted == [turns[after - 1]], c["id"]


def test_a_case_edit_gives_the_edited_conversation(convs):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    sample = [convs[0], convs[5], next(c for c in convs if c["kind"] == "span_only")]
    cases = build_cases(tok, sample, ["stub", "delete"])
    assert len(cases) == 6
    for case in cases:
        conv = next(c for c in sample if c["id"] == case.id)
        msgs, k = conv["messages"], conv["stale"]
        edited = ([*msgs[:k], {**msgs[k], "content": conv["stub"]}, *msgs[k + 1 :]]
                  if case.variant == "stub" else [*msgs[:k], *msgs[k + 1 :]])  # fmt: skip
        ids = lambda m, g=False: tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g),  # noqa: E731
                                     add_special_tokens=False)["input_ids"]  # fmt: skip
        assert case.edited == ids(edited)
        assert case.tokens == ids(msgs)
        asked = [*msgs, {"role": "user", "content": conv["question"]}]
        assert tok.decode(case.tokens + case.question).startswith(tok.decode(ids(asked, True)))
        assert case.end > case.start and case.tokens[case.start : case.end] != case.replacement


# -- the harness over HTTP (tiny llama on a real server) --------------------------------------

ARCH = "llama"


def test_the_cache_check_refuses_rows_an_arm_may_not_read():
    from leyline_agent.experiments.check.quality import _check_cache
    from leyline_agent.experiments.check.quality_arms import ARMS, Case

    case = Case("c", "general", "stub", [1, 2, 3, 4, 5, 6], 2, 4, [9], [7, 8])  # T' = 1 2 9 5 6
    _check_cache(ARMS["forget"], case, [1, 2, 9, 5, 6, 7, 8], 2, [[1, 2, 3, 4, 5, 6, 7, 8]])
    with pytest.raises(RuntimeError, match="share only 2"):  # it read T' past the edit
        _check_cache(ARMS["forget"], case, [1, 2, 9, 5, 6, 7, 8], 5, [[1, 2, 3, 4, 5, 6, 7, 8]])
    _check_cache(ARMS["amortize"], case, [1, 2, 9, 5, 6, 7, 8], 5, [])
    with pytest.raises(RuntimeError, match="did not read the splice"):
        _check_cache(ARMS["amortize"], case, [1, 2, 9, 5, 6, 7, 8], 2, [])


def test_shared_prefixes_give_the_cold_arms_answers(convs, server, tok, name):
    """--share-prefix (the demo's form) against every arm started from a flushed cache:
    the same first tokens, logprobs and fact log P, with FORGET reading the rows before the
    edit from the cache only when prefixes are shared."""
    from leyline_agent.experiments.check.quality import run_arms
    from leyline_agent.experiments.check.quality_arms import ARMS, QualityServer

    sample = [convs[0], next(c for c in convs if c["kind"] == "quoted_next")]
    cases = build_cases(tok, sample, ["stub"])
    qs = QualityServer(server.url, name)
    try:
        cold = run_arms(qs, list(ARMS.values()), cases, tok, 4)
        shared = run_arms(qs, list(ARMS.values()), cases, tok, 4, share_prefix=True)
    finally:
        qs.close()
    by = {(r.case, r.arm): r for r in cold}
    assert len(shared) == len(cold) == 2 * len(ARMS)
    for r in shared:
        c = by[(r.case, r.arm)]
        assert r.first.tokens == c.first.tokens, (r.case, r.arm)
        assert r.first.logprobs == pytest.approx(c.first.logprobs, abs=1e-4), (r.case, r.arm)
        if r.target_logprob is not None:
            assert r.target_logprob == pytest.approx(c.target_logprob, abs=1e-4)
        if r.arm == "FORGET":
            case = next(x for x in cases if x.id == r.case)
            assert c.first.cached == 0
            assert case.start <= r.first.cached <= case.start + len(case.replacement)
