"""The engine's GPU-only code paths, run on the CPU where they can be.

- A chunk after cached rows on CUDA (bf16/fp16) runs ``_gqa_extend`` on CUDA's flash op
  (``attention._flash_cuda``: k/v heads repeated for the chunk's own rows, the cached rows'
  query heads folded, the parts merged by log-sum-exp), with no ``[t, n]`` mask. Here CUDA's
  op is stood in for by the CPU flash op of the same contract, and the result is compared
  with a float64 softmax over the sequence's rows gathered out of the pool, masked causally
  from the bottom right, written here from scratch.
- The step budget and the runner's chunk are the device's (``scheduler.step_tokens_for``).
"""

from __future__ import annotations

import pytest
import torch

from leyline_agent.engine.model import attention
from leyline_agent.engine.model.context import SeqRows
from leyline_agent.engine.model.runner import slot_runs
from leyline_agent.engine.scheduler import DEFAULT_STEP_TOKENS, GPU_STEP_TOKENS, step_tokens_for

pytestmark = pytest.mark.slow


def _reference(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, slots: torch.Tensor, scale):
    """float64 attention of ``q [1, H, t, d]`` over rows ``slots`` of ``pk/pv [KVH, S, d]``,
    query i seeing rows 0..n - t + i: ``[t, H, d]``."""
    h, t = q.shape[1], q.shape[2]
    k, v = pk[:, slots].double(), pv[:, slots].double()
    k, v = k.repeat_interleave(h // k.shape[0], 0), v.repeat_interleave(h // v.shape[0], 0)
    n = k.shape[1]
    scores = q[0].double() @ k.transpose(1, 2) * scale  # [H, t, n]
    seen = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
    p = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return (p @ v).transpose(0, 1)


def _emulated_cuda_op(q, k, v, dropout, is_causal, debug, scale=None):
    """CUDA's flash op as the engine calls it, on the CPU; it has no GQA here, as the
    engine must not rely on it: k/v must come with q's head count."""
    assert k.shape[1] == q.shape[1], "heads must match"
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout, is_causal, scale=scale
    )
    return o, lse, None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("runs", [1, 3, 20], ids=lambda r: f"runs={r}")
def test_cuda_extend_path_equals_a_gathered_float64_attention(monkeypatch, dtype, runs):
    monkeypatch.setattr(attention, "_FLASH_CUDA", _emulated_cuda_op)
    monkeypatch.setattr(attention, "_flash", lambda q: attention._flash_cuda)
    g = torch.Generator().manual_seed(runs)
    h, kvh, d, cached, t = 8, 2, 64, 150, 37
    pool_rows = 600
    pk = torch.randn(kvh, pool_rows, d, generator=g).to(dtype)
    pv = torch.randn(kvh, pool_rows, d, generator=g).to(dtype)
    # the cached rows in ``runs`` runs apart from each other in the pool, then the chunk's own
    sizes = [cached // runs + (i < cached % runs) for i in range(runs)]
    gap = 400 // runs
    cached_slots = torch.cat([torch.arange(10 + i * gap, 10 + i * gap + n) for i, n in
                              enumerate(sizes)])  # fmt: skip
    slots = torch.cat([cached_slots, torch.arange(pool_rows - t, pool_rows)])
    s = SeqRows(q_start=0, q_len=t, kv_slots=slots, kv_runs=slot_runs(slots))
    assert len(s.kv_runs) == runs + 1
    q = torch.randn(1, h, t, d, generator=g).to(dtype)
    scale = d**-0.5
    got = attention._gqa_extend(q, pk, pv, s, scale)
    want = _reference(q, pk, pv, slots, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert got.shape == (t, h, d) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_the_cuda_flash_op_serves_half_precision_only():
    q = torch.zeros(1, 2, 3, 8, dtype=torch.float32)
    assert attention._flash(q) is attention._FLASH_CPU  # CPU: its own op, any dtype
    meta = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16, device="meta")
    assert attention._flash(meta) is None  # neither CPU nor CUDA: the dense-mask path


def test_the_step_budget_and_chunk_are_the_devices():
    from types import SimpleNamespace

    from leyline_agent.engine.stepper import Stepper

    assert step_tokens_for("cpu") == DEFAULT_STEP_TOKENS == 512
    assert step_tokens_for("cuda") == GPU_STEP_TOKENS > DEFAULT_STEP_TOKENS
    for dev, want in (("cpu", DEFAULT_STEP_TOKENS), ("cuda", GPU_STEP_TOKENS)):
        host = SimpleNamespace(runner=SimpleNamespace(device=torch.device(dev)))
        assert Stepper(host).step_tokens == want  # type: ignore[arg-type]
        assert Stepper(host, step_tokens=64).step_tokens == 64  # type: ignore[arg-type]


def test_the_tail_moves_in_one_section_on_a_gpu_with_the_same_bytes(monkeypatch):
    """``executor.move_rows_for``: CPU sections of ``MOVE_ROWS`` rows, one section on CUDA.
    A splice whose tail moves in one section leaves the same cache, bitwise, as the CPU's
    sections (here both on the CPU, the section size forced)."""
    from leyline_agent.engine import executor
    from leyline_agent.engine.checkpoints.store import tiny_model_dir
    from leyline_agent.engine.engine import Engine, SamplingParams
    from leyline_agent.engine.executor import GPU_MOVE_ROWS, MOVE_ROWS, move_rows_for
    from leyline_agent.wire import DirectivesRequest

    assert move_rows_for("cpu") == MOVE_ROWS and move_rows_for("cuda") == GPU_MOVE_ROWS
    T = [3 + (i * 7919) % 500 for i in range(2600)]
    d = {"start": 100, "end": 140, "replacement": [5, 6, 7], "mode": "amortize"}
    out = []
    for rows in (MOVE_ROWS, GPU_MOVE_ROWS):
        monkeypatch.setattr(executor, "move_rows_for", lambda _t, rows=rows: rows)
        eng = Engine.from_pretrained(tiny_model_dir("llama"), cache_budget_tokens=8192)
        eng.generate(T, SamplingParams(max_tokens=0))
        calls = []
        real = eng.pool.copy_rotated
        monkeypatch.setattr(
            eng.pool, "copy_rotated", lambda *a, c=calls, f=real: c.append(1) or f(*a)
        )
        resp = eng.apply_directives(DirectivesRequest(tokens=T, directives=[d]))
        m = eng.cache.tree.match_prefix(list(resp.tokens))
        assert m.length == len(resp.tokens)
        out.append((len(calls), eng.pool.snapshot(m.slots)))
    tail = len(T) - 140
    assert out[0][0] == -(-tail // MOVE_ROWS) and out[1][0] == 1
    for a, b in zip(out[0][1], out[1][1], strict=True):
        assert torch.equal(a, b)
