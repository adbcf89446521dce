"""The paged engine against independent computations (fp32, tiny models, CPU).

Ground truth: a plain transformers forward of the whole sequence (a separately loaded model,
no cache) and transformers' own DeepSeek attention module."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine, SamplingParams
from leyline_agent.engine.model import attention
from leyline_agent.engine.model.attention import mla_absorbed, mla_project
from leyline_agent.engine.model.runner import StepInput, slot_runs
from leyline_agent.kernels import decode_attn

pytestmark = pytest.mark.slow

ARCHS = ["deepseek_v2", "deepseek_v3", "llama", "qwen3"]
TOL = 1e-4


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def _truth(ref, ids):
    return ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    arch = request.param
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32).eval()
    return Engine.from_pretrained(tiny_model_dir(arch)), ref


def test_prefill_chunked_extend_and_decode_equal_a_full_forward(pair):
    eng, ref = pair
    r = eng.runner
    ids = _ids(1, 160, eng.vocab_size)
    truth = _truth(ref, ids)
    old_chunk, r.chunk = r.chunk, 48  # chunked prefill: 4 chunks, the later ones over cached rows
    try:
        fresh, lg = r.prefill([], ids[:130])
    finally:
        r.chunk = old_chunk
    assert (lg - truth[129]).abs().max() <= TOL
    more, lg = r.prefill(fresh, ids[130:150])  # a short extend after a cached prefix
    assert (lg - truth[149]).abs().max() <= TOL
    slots = fresh + more
    for i in range(150, 160):  # decode, one token per forward
        slots += r.allocator.alloc(1)
        out = r.run([StepInput([ids[i]], slots)])
        assert (out[0] - truth[i]).abs().max() <= TOL
    r.allocator.free(slots)


def _decode_path(path: str, monkeypatch) -> None:
    """``kernel``: decode through kernels/decode_attn.c (it must have built here); the others
    switch it off and take a torch path: MLA fused SDPA or blocked GEMMs; GQA flash attention
    per run merged by log-sum-exp, or, with no CPU flash kernel, the runs' scores side by side."""
    if path == "kernel":
        assert decode_attn.available(), decode_attn.build_error()
        monkeypatch.setattr(attention, "USE_DECODE_KERNEL", True)
        return
    monkeypatch.setattr(attention, "USE_DECODE_KERNEL", False)
    if path == "blocked":
        monkeypatch.setattr(attention, "_FUSED_MAX_SCORES", 0)
    if path == "no-flash":
        monkeypatch.setattr(attention, "_FLASH_CPU", None)


@pytest.mark.parametrize("path", ["kernel", "fused", "blocked", "no-flash"])
def test_decode_over_rows_in_many_runs_equals_a_full_forward(pair, path, monkeypatch):
    """Decode rows that do not follow each other in the pool (another sequence allocates in
    between): attention reads them run by run (the torch paths: past ``_MAX_RUNS`` runs, one
    gathered copy)."""
    _decode_path(path, monkeypatch)
    eng, ref = pair
    r = eng.runner
    ids = _ids(5, 60, eng.vocab_size)
    truth = _truth(ref, ids)
    slots, _ = r.prefill([], ids[:36])
    gaps = []
    for i in range(36, 60):  # 24 decodes: 2 .. 25 runs
        gaps += r.allocator.alloc(1)  # someone else's row between each two of ours
        slots += r.allocator.alloc(1)
        out = r.run([StepInput([ids[i]], slots)])
        assert (out[0] - truth[i]).abs().max() <= TOL, f"decode at {i}"
    r.allocator.free(slots + gaps)


@pytest.mark.parametrize("path", ["kernel", "fused", "blocked"])
def test_a_batch_gives_each_sequence_what_it_gets_alone(pair, path, monkeypatch):
    _decode_path(path, monkeypatch)  # blocked: MLA's explicit latent GEMMs (long contexts)
    eng, ref = pair
    r = eng.runner
    seqs = [_ids(10 + k, 20 + 7 * k, eng.vocab_size) for k in range(4)]
    truths = [_truth(ref, s) for s in seqs]
    prefixes = [r.prefill([], s[:-3])[0] for s in seqs]
    # one packed forward: two decodes, one 2-token extend, one whole prefill
    inputs, owned = [], []
    for k, (s, pre) in enumerate(zip(seqs, prefixes, strict=True)):
        if k == 3:
            slots = r.allocator.alloc(len(s))
            inputs.append(StepInput(s, slots))
            owned.append((slots, len(s) - 1))
            continue
        n_new = 2 if k == 2 else 1
        start = len(s) - 3
        slots = pre + r.allocator.alloc(n_new)
        inputs.append(StepInput(s[start : start + n_new], slots))
        owned.append((slots, start + n_new - 1))
    out = r.run(inputs)
    for k, (slots, last) in enumerate(owned):
        assert (out[k] - truths[k][last]).abs().max() <= TOL
        r.allocator.free(slots)


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("path", ["split", "masked"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_extend_over_rows_in_many_runs_equals_a_full_forward(arch, path, gathered, monkeypatch):
    """GQA chunks after cached rows that lie in several runs, their own rows in several too
    (other sequences allocate in between). ``split``: the CPU path that attends the cached
    runs unmasked and its own rows causally, merged by log-sum-exp (``gathered``: past
    ``_MAX_RUNS`` runs, one copy); ``masked``: one SDPA call with the chunk's mask (no CPU
    flash kernel). Every later token's logits check the chunk's KV too."""
    calls = []
    real = attention._gqa_extend
    monkeypatch.setattr(attention, "_gqa_extend", lambda *a: calls.append(1) or real(*a))
    if path == "masked":
        monkeypatch.setattr(attention, "_FLASH_CPU", None)
    if gathered:
        monkeypatch.setattr(attention, "_MAX_RUNS", 1)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32).eval()
    r = Engine.from_pretrained(tiny_model_dir(arch)).runner
    ids = _ids(21, 90, r.model.config.vocab_size)
    truth = _truth(ref, ids)
    slots, gaps = [], []
    for at, n in ((0, 20), (20, 1), (21, 13), (34, 30), (64, 26)):  # prefill, then extends
        new: list[int] = []
        for _ in range(n):  # someone else's row after every third of ours
            new += r.allocator.alloc(1)
            if len(new) % 3 == 0:
                gaps += r.allocator.alloc(1)
        out = r.run([StepInput(ids[at : at + n], slots + new)])
        slots += new
        assert (out[0] - truth[at + n - 1]).abs().max() <= TOL, f"chunk at {at}"
    assert len(slot_runs(torch.tensor(slots))) > 20
    layers = r.model.config.num_hidden_layers  # split: the 13-, 30- and 26-token chunks
    assert len(calls) == (3 * layers if path == "split" else 0)
    r.allocator.free(slots + gaps)


@pytest.mark.parametrize("path", ["fused", "blocked"])
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_absorbed_mla_equals_transformers_attention_module(arch, path, monkeypatch):
    if path == "blocked":  # the explicit GEMMs that long contexts take, in blocks of 2 queries
        monkeypatch.setattr(attention, "_FUSED_MAX_SCORES", 0)
        monkeypatch.setattr(attention, "_SCORE_BLOCK", 2 * 4 * 37)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32).eval()
    attn = ref.model.layers[1].self_attn
    g = torch.Generator().manual_seed(3)
    h = torch.randn(1, 37, ref.config.hidden_size, generator=g)
    pos = torch.arange(37)[None]
    with torch.inference_mode():
        pe = ref.model.rotary_emb(h, pos)
        truth = attn(hidden_states=h, attention_mask=None, position_embeddings=pe)[0]
        # the same module, in latent space (one query at a time and all at once)
        qn, qp, c, kp = mla_project(attn, h, pe)
        full = mla_absorbed(attn, qn, qp, c, kp)
        ours = attn.o_proj(full.transpose(0, 1).reshape(1, 37, -1))
        last = attn.o_proj(mla_absorbed(attn, qn[:, -1:], qp[:, -1:], c, kp).reshape(1, 1, -1))
    assert (ours - truth).abs().max() <= 1e-5
    assert (last - truth[:, -1:]).abs().max() <= 1e-5


def test_concurrent_generate_equals_each_alone_and_a_bad_directive_changes_nothing():
    eng = Engine.from_pretrained(tiny_model_dir("deepseek_v2"))
    prompts = [_ids(40 + k, 30 + 5 * k, eng.vocab_size) for k in range(4)]
    p = SamplingParams(max_tokens=12, stop_token_ids=[])
    alone = [eng.generate(q, p).output_ids for q in prompts]
    eng2 = Engine.from_pretrained(tiny_model_dir("deepseek_v2"))
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(len(prompts) + 1)

    def run(k: int) -> None:
        def on_token(tok: int, delta: str) -> None:
            if len(got.setdefault(-1 - k, [])) == 0:
                got[-1 - k].append(tok)
                started.wait(30)

        try:
            got[k] = eng2.generate(prompts[k], p, on_token).output_ids
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait(30)  # every sequence is running: now a bad directive, between steps
    from leyline_agent.errors import LeylineError
    from leyline_agent.namespaces import ANONYMOUS
    from leyline_agent.wire import DirectivesRequest

    m = eng2.cache.match(prompts[0], ANONYMOUS)
    rows_before = eng2.pool.snapshot(m.slots)
    tree_before = eng2.cache.total_tokens
    stats_before = eng2.stats().model_dump()
    with pytest.raises(LeylineError, match="directives"):
        eng2.apply_directives(
            DirectivesRequest(
                tokens=prompts[0],
                directives=[{"start": 2, "end": 3, "replacement": [10**9], "mode": "amortize"}],
            )
        )
    assert eng2.cache.total_tokens == tree_before
    assert eng2.stats().model_dump() == stats_before
    after = eng2.pool.snapshot(m.slots)
    assert all(torch.equal(a, b) for a, b in zip(rows_before, after, strict=True))
    for t in threads:
        t.join(60)
    assert not errors
    assert [got[k] for k in range(len(prompts))] == alone
    assert eng2.stepper.steps < sum(len(a) + 2 for a in alone)  # they shared steps
    # decode rows came in blocks: each sequence's rows are one run per prefill and per
    # decode block, not one per token; what the blocks did not use went back to the pool
    for k, q in enumerate(prompts):
        m = eng2.cache.match(q + alone[k][:-1], ANONYMOUS)
        assert m.length == len(q) + len(alone[k]) - 1
        assert len(slot_runs(torch.tensor(m.slots[len(q) :]))) == 1
    assert eng2.allocator.num_used == eng2.cache.total_tokens


def test_a_failing_step_fails_its_sequences_and_leaks_nothing(monkeypatch):
    """The step thread's forward raises mid-decode: every running sequence's owner gets the
    error, their rows are freed, and the engine then serves as a fresh one would."""
    eng = Engine.from_pretrained(tiny_model_dir("llama"))
    prompts = [_ids(70 + k, 24, eng.vocab_size) for k in range(2)]
    p = SamplingParams(max_tokens=8, stop_token_ids=[])
    real_run, calls = eng.runner.run, []

    def run(batch):
        calls.append(len(batch))
        if len(calls) == 3:  # a decode step, after both prompts were prefilled
            raise RuntimeError("forward failed")
        return real_run(batch)

    monkeypatch.setattr(eng.runner, "run", run)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def go(q):
        barrier.wait(30)
        try:
            eng.generate(q, p)
        except RuntimeError as e:
            errors.append(e)

    threads = [threading.Thread(target=go, args=(q,)) for q in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errors) >= 1 and all(str(e) == "forward failed" for e in errors)
    assert not eng.stepper.running
    assert eng.allocator.num_used == eng.cache.total_tokens  # failed rows freed, none leaked
    got = [eng.generate(q, p).output_ids for q in prompts]
    fresh = Engine.from_pretrained(tiny_model_dir("llama"))
    assert got == [fresh.generate(q, p).output_ids for q in prompts]
