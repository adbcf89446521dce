"""AMORTIZE splice of the SGLang plugin on SGLang's REAL RadixCache, allocator and KV pools.

The pools hold KV of the tiny models (DeepseekV2: MLA pool; Llama, Qwen3: MHA pool) for a
rendered chat. Expected values come from ``RefState``, which shares nothing with the
plugin: pre-RoPE keys captured with hooks and re-roped by the model's own RoPE at the new
positions (no rotate_band at all). ``T'`` lands in the session's radix namespace (SGLang's
``extra_key``; the anonymous session's here); ``test_sglang_namespaces.py`` covers the
isolation itself.
"""

from __future__ import annotations

import pytest
import torch

from leyline_agent.directives import Directive
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine
from leyline_agent.namespaces import Namespace
from leyline_agent.reference.kv_reference import RefState
from leyline_agent.sglang_plugin.splice import splice_amortize
from leyline_agent.sglang_plugin.treeview import radix_key
from leyline_agent.testing import sglang_pools as sp

ANON = Namespace().key

MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent."},
    {"role": "user", "content": "List the files, then open config.py."},
    {"role": "assistant", "content": "Running ls."},
    {
        "role": "tool",
        "content": "config.py main.py utils.py README.md setup.cfg tests/ docs/ build/",
    },
    {"role": "user", "content": "Summarise what you found."},
]


@pytest.fixture(scope="module", params=["deepseek_v2", "llama", "qwen3"])
def engine(request) -> Engine:
    return Engine.from_pretrained(tiny_model_dir(request.param))


def _case(engine: Engine, change: str) -> tuple[list[int], Directive]:
    tokens = engine.render(MESSAGES)
    if change == "shrink":  # stub a tool output: the tail moves left
        repl = engine.tokenizer.encode("[removed]", add_special_tokens=False)
        return tokens, Directive(start=40, end=70, replacement=repl)
    repl = engine.tokenizer.encode(
        "a much longer replacement text than the span it replaces", add_special_tokens=False
    )
    return tokens, Directive(start=20, end=24, replacement=repl)  # the tail moves right


def _match(cache: sp.SGLangCache, tokens: list[int], key: str | None = ANON):
    return sp.match(cache, tokens, key)


def _no_leak(cache: sp.SGLangCache) -> None:
    assert cache.tree.protected_size() == 0
    assert cache.allocator.available_size() + sp.held_slots(cache) == cache.initial_free


@pytest.mark.parametrize("change", ["shrink", "grow"])
def test_sglang_amortize_matches_reference(engine: Engine, change: str) -> None:
    tokens, d = _case(engine, change)
    s, e, repl = d.start, d.end, list(d.replacement)
    new_tokens = tokens[:s] + repl + tokens[e:]
    head = s + len(repl)
    cache = sp.build_cache(engine.config, size=512)
    old_slots = sp.prefill(cache, engine.model, tokens)
    head_slots = sp.prefill(cache, engine.model, tokens[:s] + repl)  # SGLang's prefill of R
    before = sp.rows(cache, old_slots)
    head_rows = sp.rows(cache, head_slots)

    result = splice_amortize(cache.target(), tokens, d)

    assert result.rotated_tokens == len(tokens) - e and result.namespace == ANON
    assert result.copied_tokens == head and result.reused_tokens == 0
    n, new_slots = _match(cache, new_tokens)
    assert n == len(new_tokens), "match_prefix(T') in the session's namespace covers T'"
    assert not set(new_slots.tolist()) & (set(old_slots.tolist()) | set(head_slots.tolist()))
    assert _match(cache, new_tokens, None)[0] == head, "the plain tree has the exact head only"
    # the old path T still matches in the plain tree, same slots, same bytes
    n_old, again = _match(cache, tokens, None)
    assert n_old == len(tokens) and torch.equal(again, old_slots)
    for (a0, b0), (a1, b1) in zip(before, sp.rows(cache, old_slots), strict=True):
        assert torch.equal(a0, a1) and torch.equal(b0, b1)

    after = sp.rows(cache, new_slots)
    ref = RefState.prefill(engine.model, tokens).amortize(s, e, repl).kv()
    for layer, (x, y) in enumerate(after):
        # the head is a bitwise copy of the plain tree's rows (namespaces share no slots)
        if cache.kind == "mla":
            assert torch.equal(x[:head], head_rows[layer][0])
            assert torch.equal(y[:head], head_rows[layer][1])
        else:
            assert torch.equal(x[:, :head], head_rows[layer][0])
            assert torch.equal(y[:, :head], head_rows[layer][1])
        if cache.kind == "mla":  # x: latent [n, r], y: k_pe [n, rope]
            assert torch.equal(x[head:], before[layer][0][e:]), f"layer {layer}: latent not bitwise"
            rot, rot_ref = y[head:], ref[layer][1][0, 0, head:]
        else:  # x: keys [H, n, D], y: values [H, n, D]
            assert torch.equal(y[:, head:], before[layer][1][:, e:]), f"layer {layer}: values"
            rot, rot_ref = x[:, head:], ref[layer][0][0, :, head:]
        torch.testing.assert_close(rot, rot_ref, rtol=1e-4, atol=5e-5)
        moved = rot if cache.kind == "mla" else rot.transpose(0, 1)
        orig = (
            before[layer][1][e:] if cache.kind == "mla" else before[layer][0][:, e:].transpose(0, 1)
        )
        assert not torch.allclose(moved, orig, atol=1e-3), "the band must actually move"

    # locks released, nothing leaked: evicting everything restores the initial free size
    _no_leak(cache)
    assert cache.tree.evictable_size() == cache.tree.total_size()
    sp.evict_all(cache)
    assert cache.allocator.available_size() == cache.initial_free
    assert cache.tree.total_size() == 0


def test_sglang_second_session_sharing_prefix(engine: Engine) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    tokens, d = _case(engine, "shrink")
    other = tokens[:50] + engine.tokenizer.encode(
        "a different session continues here", add_special_tokens=False
    )
    cache = sp.build_cache(engine.config, size=512)
    sp.prefill(cache, engine.model, tokens)
    other_slots = sp.prefill(cache, engine.model, other)
    other_rows = sp.rows(cache, other_slots)
    # the second session is running: SGLang holds a lock on its path
    m = cache.tree.match_prefix(MatchPrefixParams(key=radix_key(other)))
    lock = cache.tree.lock(m.last_device_node)
    sp.prefill(cache, engine.model, tokens[: d.start] + list(d.replacement))
    splice_amortize(cache.target(), tokens, d)

    new_tokens = tokens[: d.start] + list(d.replacement) + tokens[d.end :]
    assert _match(cache, new_tokens)[0] == len(new_tokens)
    n, slots = _match(cache, other, None)
    assert n == len(other) and torch.equal(slots, other_slots)
    for (a0, b0), (a1, b1) in zip(other_rows, sp.rows(cache, other_slots), strict=True):
        assert torch.equal(a0, a1) and torch.equal(b0, b1)

    sp.evict_all(cache)  # everything but the locked session goes
    assert _match(cache, other, None)[0] == len(other)
    assert cache.allocator.available_size() == cache.initial_free - len(other)
    cache.tree.unlock(lock)
    sp.evict_all(cache)
    assert cache.allocator.available_size() == cache.initial_free


def test_sglang_splice_again_is_a_no_op(engine: Engine) -> None:
    tokens, d = _case(engine, "grow")
    cache = sp.build_cache(engine.config, size=512)
    sp.prefill(cache, engine.model, tokens)
    sp.prefill(cache, engine.model, tokens[: d.start] + list(d.replacement))
    first = splice_amortize(cache.target(), tokens, d)
    snap = sp.snapshot(cache)
    second = splice_amortize(cache.target(), tokens, d)
    assert first.rotated_tokens == len(tokens) - d.end and second.rotated_tokens == 0
    sp.snapshot(cache).assert_equal(snap)
    _no_leak(cache)
    sp.evict_all(cache)
    assert cache.allocator.available_size() == cache.initial_free


def test_sglang_amortize_bf16_mla_pool() -> None:
    """SGLang serves DeepSeek with a bf16 KV cache: latent copied bitwise, k_pe rotated in
    fp32 and stored in bf16 (compared with the reference at bf16 resolution)."""
    eng = Engine.from_pretrained(tiny_model_dir("deepseek_v2"))
    tokens, d = _case(eng, "shrink")
    s, e, repl = d.start, d.end, list(d.replacement)
    head = s + len(repl)
    cache = sp.build_cache(eng.config, size=512, dtype=torch.bfloat16)
    old_slots = sp.prefill(cache, eng.model, tokens)
    sp.prefill(cache, eng.model, tokens[:s] + repl)
    before = sp.rows(cache, old_slots)
    splice_amortize(cache.target(), tokens, d)
    new_tokens = tokens[:s] + repl + tokens[e:]
    n, slots = _match(cache, new_tokens)
    assert n == len(new_tokens)
    ref = RefState.prefill(eng.model, tokens).amortize(s, e, repl).kv()
    for layer, (latent, kpe) in enumerate(sp.rows(cache, slots)):
        assert latent.dtype == torch.bfloat16
        assert torch.equal(latent[head:], before[layer][0][e:])
        expected = ref[layer][1][0, 0, head:]
        torch.testing.assert_close(kpe[head:].float(), expected, rtol=2e-2, atol=2e-2)
    sp.evict_all(cache)
    assert cache.allocator.available_size() == cache.initial_free
