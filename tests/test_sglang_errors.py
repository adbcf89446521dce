"""Refused splices on SGLang's real tree/allocator/pool: a clear error, nothing changed.

``Snapshot`` holds every node (key, slots, lock_ref), the tree's evictable/protected sizes,
the allocator's free lists and every KV buffer; it must be bitwise the same afterwards.
"""

from __future__ import annotations

import pytest
import torch

from leyline_agent.directives import Directive, Mode
from leyline_agent.errors import CacheMissError, DirectiveError, RuntimeUnavailableError
from leyline_agent.runtime.engine import Engine
from leyline_agent.sglang_plugin.plan import plan_amortize
from leyline_agent.sglang_plugin.splice import splice_amortize
from leyline_agent.testing import sglang_pools as sp
from leyline_agent.testing.models import tiny_model_dir

MESSAGES = [
    {"role": "user", "content": "Open the file and show me the failing test output."},
    {"role": "assistant", "content": "Here it is."},
    {"role": "tool", "content": "FAILED test_config.py::test_load - KeyError: 'path'"},
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(tiny_model_dir("deepseek_v2"))


@pytest.fixture()
def filled(engine: Engine):
    tokens = engine.render(MESSAGES)
    repl = engine.tokenizer.encode("[stub]", add_special_tokens=False)
    cache = sp.build_cache(engine.config, size=256)
    sp.prefill(cache, engine.model, tokens)
    sp.prefill(cache, engine.model, tokens[:10] + repl)
    return cache, tokens, repl


def _refused(cache, tokens, directive, error, *words) -> None:
    snap = sp.snapshot(cache)
    with pytest.raises(error) as info:
        splice_amortize(cache.target(), tokens, directive)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    sp.snapshot(cache).assert_equal(snap)


def test_sglang_span_outside_sequence(filled) -> None:
    cache, tokens, repl = filled
    d = Directive(start=10, end=len(tokens) + 3, replacement=repl)
    _refused(cache, tokens, d, DirectiveError, "directive", "outside the sequence")


def test_sglang_base_not_cached(filled, engine: Engine) -> None:
    cache, _, repl = filled
    other = engine.tokenizer.encode("something never sent before", add_special_tokens=False)
    d = Directive(start=2, end=5, replacement=repl)
    _refused(cache, other, d, CacheMissError, "not in the radix cache")


def test_sglang_span_beyond_cached_part(filled, engine: Engine) -> None:
    cache, tokens, repl = filled
    longer = tokens + engine.tokenizer.encode(
        "a reply that was never cached", add_special_tokens=False
    )
    d = Directive(start=10, end=len(tokens) + 2, replacement=repl)
    _refused(cache, longer, d, CacheMissError, "directive.end", "cached part")


def test_sglang_replacement_not_prefilled(filled, engine: Engine) -> None:
    cache, tokens, _ = filled
    other = engine.tokenizer.encode("never prefilled", add_special_tokens=False)
    d = Directive(start=10, end=20, replacement=other)
    _refused(cache, tokens, d, CacheMissError, "replacement", "prefilled")


def test_sglang_negative_positions(filled) -> None:
    cache, tokens, repl = filled
    # Directive() refuses start < 0 itself; a constructed one must not slip through either
    d = Directive.model_construct(start=-4, end=2, replacement=repl, mode=Mode.AMORTIZE)
    _refused(cache, tokens, d, DirectiveError, "directive")
    empty = torch.empty(0, dtype=torch.int64)
    with pytest.raises(DirectiveError, match="below 0|outside"):
        plan_amortize(tokens, d, len(tokens), empty, 0, empty)


def test_sglang_forget_is_not_spliced(filled) -> None:
    cache, tokens, repl = filled
    d = Directive(start=10, end=20, replacement=repl, mode=Mode.FORGET)
    _refused(cache, tokens, d, DirectiveError, "FORGET")


def test_sglang_pool_full(engine: Engine) -> None:
    tokens = engine.render(MESSAGES)
    repl = engine.tokenizer.encode("[stub]", add_special_tokens=False)
    cache = sp.build_cache(engine.config, size=len(tokens) + 12)
    sp.prefill(cache, engine.model, tokens)
    sp.prefill(cache, engine.model, tokens[:10] + repl)
    d = Directive(start=10, end=20, replacement=repl)
    _refused(cache, tokens, d, RuntimeUnavailableError, "KV pool full")


def test_sglang_paged_tree_refused(engine: Engine) -> None:
    cache = sp.build_cache(engine.config, size=64)
    cache.tree.page_size = 4
    d = Directive(start=0, end=0, replacement=[])
    _refused(cache, [1, 2, 3], d, RuntimeUnavailableError, "page_size")
