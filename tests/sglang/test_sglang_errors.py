"""Refused splices on SGLang's real tree/allocator/pool: a clear error, nothing changed.

``Snapshot`` holds every node (namespace, key, slots, lock_ref), the tree's
evictable/protected sizes, the allocator's free lists and every KV buffer; it must be
bitwise the same afterwards. Each refusal runs for the anonymous session and for a named
one (whose first splice would copy the head out of the plain tree), plus the refusals only
namespaces have: another session's rows as the base, a FORGET of rows in use.
"""

from __future__ import annotations

import pytest
import torch

from leyline_agent.directives import Directive, Mode
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine
from leyline_agent.errors import CacheMissError, DirectiveError, RuntimeUnavailableError
from leyline_agent.namespaces import Namespace
from leyline_agent.sglang_plugin.forget import forget_rows
from leyline_agent.sglang_plugin.plan import plan_amortize
from leyline_agent.sglang_plugin.splice import splice_amortize
from leyline_agent.testing import sglang_pools as sp

MESSAGES = [
    {"role": "user", "content": "Open the file and show me the failing test output."},
    {"role": "assistant", "content": "Here it is."},
    {"role": "tool", "content": "FAILED test_config.py::test_load - KeyError: 'path'"},
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(tiny_model_dir("deepseek_v2"))


@pytest.fixture(params=[None, "s1"], ids=["anonymous", "named"])
def ns(request) -> str:
    return Namespace(session=request.param).key


@pytest.fixture()
def filled(engine: Engine):
    tokens = engine.render(MESSAGES)
    repl = engine.tokenizer.encode("[stub]", add_special_tokens=False)
    cache = sp.build_cache(engine.config, size=256)
    sp.prefill(cache, engine.model, tokens)
    sp.prefill(cache, engine.model, tokens[:10] + repl)
    return cache, tokens, repl


ANON = Namespace().key


def _refused(cache, tokens, directive, error, *words, ns=ANON, op=splice_amortize):
    snap = sp.snapshot(cache)
    with pytest.raises(error) as info:
        op(cache.target(), tokens, directive, ns)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    sp.snapshot(cache).assert_equal(snap)


def test_sglang_span_outside_sequence(filled, ns: str) -> None:
    cache, tokens, repl = filled
    d = Directive(start=10, end=len(tokens) + 3, replacement=repl)
    _refused(cache, tokens, d, DirectiveError, "directive", "outside the sequence", ns=ns)


def test_sglang_base_not_cached(filled, engine: Engine, ns: str) -> None:
    cache, _, repl = filled
    other = engine.tokenizer.encode("something never sent before", add_special_tokens=False)
    d = Directive(start=2, end=5, replacement=repl)
    _refused(cache, other, d, CacheMissError, "not in the radix cache", ns=ns)


def test_sglang_span_beyond_cached_part(filled, engine: Engine, ns: str) -> None:
    cache, tokens, repl = filled
    longer = tokens + engine.tokenizer.encode(
        "a reply that was never cached", add_special_tokens=False
    )
    d = Directive(start=10, end=len(tokens) + 2, replacement=repl)
    _refused(cache, longer, d, CacheMissError, "directive.end", "cached part", ns=ns)


def test_sglang_replacement_not_prefilled(filled, engine: Engine, ns: str) -> None:
    cache, tokens, _ = filled
    other = engine.tokenizer.encode("never prefilled", add_special_tokens=False)
    d = Directive(start=10, end=20, replacement=other)
    _refused(cache, tokens, d, CacheMissError, "replacement", "prefilled", ns=ns)


def test_sglang_negative_positions(filled) -> None:
    cache, tokens, repl = filled
    # Directive() refuses start < 0 itself; a constructed one must not slip through either
    d = Directive.model_construct(start=-4, end=2, replacement=repl, mode=Mode.AMORTIZE)
    _refused(cache, tokens, d, DirectiveError, "directive")
    empty = torch.empty(0, dtype=torch.int64)
    with pytest.raises(DirectiveError, match="below 0|outside"):
        plan_amortize(tokens, d, (len(tokens), empty), (0, empty))


def test_sglang_forget_is_not_spliced(filled, ns: str) -> None:
    cache, tokens, repl = filled
    d = Directive(start=10, end=20, replacement=repl, mode=Mode.FORGET)
    _refused(cache, tokens, d, DirectiveError, "FORGET", ns=ns)


def test_sglang_pool_full(engine: Engine, ns: str) -> None:
    tokens = engine.render(MESSAGES)
    repl = engine.tokenizer.encode("[stub]", add_special_tokens=False)
    cache = sp.build_cache(engine.config, size=len(tokens) + 12)
    sp.prefill(cache, engine.model, tokens)
    sp.prefill(cache, engine.model, tokens[:10] + repl)
    d = Directive(start=10, end=20, replacement=repl)
    _refused(cache, tokens, d, RuntimeUnavailableError, "KV pool full", ns=ns)


def test_sglang_paged_tree_refused(engine: Engine) -> None:
    cache = sp.build_cache(engine.config, size=64)
    cache.tree.page_size = 4
    d = Directive(start=0, end=0, replacement=[])
    _refused(cache, [1, 2, 3], d, RuntimeUnavailableError, "page_size")


def test_sglang_base_only_in_another_session(filled, engine: Engine) -> None:
    """Session B cannot splice on rows only session A holds: nothing is adopted across."""
    cache, tokens, repl = filled
    a, b = Namespace(session="a").key, Namespace(session="b").key
    splice_amortize(cache.target(), tokens, Directive(start=10, end=20, replacement=repl), a)
    t1 = tokens[:10] + repl + tokens[20:]
    d = Directive(start=len(t1) - 6, end=len(t1) - 2, replacement=repl)
    # B's requests for t1 go to the plain tree, which holds the exact head only
    _refused(cache, t1, d, CacheMissError, "cached part", f"only {10 + len(repl)} of", ns=b)


def test_sglang_bad_namespace(filled) -> None:
    cache, tokens, repl = filled
    d = Directive(start=10, end=20, replacement=repl)
    _refused(cache, tokens, d, DirectiveError, "namespace", ns="not-a-leyline-key")


def test_sglang_forget_of_rows_in_use(filled) -> None:
    """A running request of the session holds its spliced rows: the FORGET that would drop
    them is refused, nothing changed; once it has finished, the FORGET goes through."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    from leyline_agent.sglang_plugin.treeview import radix_key

    cache, tokens, repl = filled
    a = Namespace(session="a").key
    splice_amortize(cache.target(), tokens, Directive(start=10, end=20, replacement=repl), a)
    t1 = tokens[:10] + repl + tokens[20:]
    m = cache.tree.match_prefix(MatchPrefixParams(key=radix_key(t1, a)))
    lock = cache.tree.lock(m.last_device_node)
    # a FORGET that coincides with the AMORTIZE: T' is t1 again, its rows from 10 must go
    forget = Directive(start=10, end=10 + len(repl), replacement=repl, mode=Mode.FORGET)
    _refused(cache, t1, forget, RuntimeUnavailableError, "in use", ns=a, op=forget_rows)
    _refused(cache, t1, forget.model_copy(update={"mode": Mode.AMORTIZE}), DirectiveError,
             "not FORGET", ns=a, op=forget_rows)  # fmt: skip
    cache.tree.unlock(lock)
    held = sp.held_slots(cache)
    plan = forget_rows(cache.target(), t1, forget, a)
    assert plan.dropped_tokens == len(t1) - 10 and sp.held_slots(cache) == held - len(t1) + 10
    assert sp.match(cache, t1, a)[0] == 10
    assert cache.allocator.available_size() + sp.held_slots(cache) == cache.initial_free
