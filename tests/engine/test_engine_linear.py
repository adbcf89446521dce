"""oneDNN-packed linear weights (``engine/model/linear.py``) against ``F.linear`` and against a
plain transformers forward of a separately loaded model (fp32, tiny models, CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine
from leyline_agent.engine.model.context import AttnContext, forward_context
from leyline_agent.engine.model.linear import install_packed, packed_available
from leyline_agent.engine.model.runner import StepInput
from leyline_agent.kernels import skinny_linear

pytestmark = pytest.mark.skipif(
    not packed_available(torch.device("cpu"), torch.float32), reason="torch without mkldnn"
)
TOL = 1e-4


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(tiny_model_dir("llama"))


def _ctx(eng):
    """An engine forward's context (what switches the packed path on)."""
    return forward_context(AttnContext(eng.pool, torch.empty(0, dtype=torch.long), ()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_for_every_row_count(engine, dtype, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 80, bias=bias).to(dtype)
    assert install_packed(torch.nn.Sequential(lin)) == 1
    w, b = lin.weight.double(), None if lin.bias is None else lin.bias.double()
    tol = 1e-5 if dtype is torch.float32 else 3e-2
    with torch.inference_mode(), _ctx(engine):
        for rows in range(1, 18):
            x = torch.randn(1, rows, 96).to(dtype)
            got = lin(x)
            assert got.shape == (1, rows, 80) and got.dtype == dtype
            assert (got.double() - F.linear(x.double(), w, b)).abs().max() <= tol, rows


def test_a_weight_changed_in_place_is_repacked(engine):
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 32)
    install_packed(torch.nn.Sequential(lin))
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        lin.weight.mul_(-2.0)  # after packing
    with torch.inference_mode(), _ctx(engine):
        got = lin(x)
    assert (got - F.linear(x, lin.weight, lin.bias)).abs().max() <= 1e-5


def test_outside_an_engine_forward_the_layer_is_transformers_own(engine):
    """A plain forward (no attention context: the tests' ground truth) never takes the packed
    copy: a stale packed weight (version counter forced equal) would show in the output."""
    torch.manual_seed(2)
    lin = torch.nn.Linear(64, 32)
    install_packed(torch.nn.Sequential(lin))
    packed, _ = lin._leyline_packed
    with torch.no_grad():
        lin.weight.add_(1.0)
    lin._leyline_packed = (packed, lin.weight._version)  # stale on purpose
    x = torch.randn(1, 8, 64)
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        with _ctx(engine):
            assert not torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias))


def _decode_batch(runner, seqs):
    """Each sequence's last token as one decode step over its prefilled prefix."""
    batch = []
    for ids in seqs:
        slots = runner.prefill_into_slots([], ids[:-1]) + runner.allocator.alloc(1)
        batch.append(StepInput([ids[-1]], slots))
    return batch


@pytest.mark.parametrize("arch", ["deepseek_v2", "llama"])
def test_a_batched_decode_on_packed_weights_equals_full_forwards(arch):
    eng = Engine.from_pretrained(tiny_model_dir(arch))
    assert eng.runner.packed_linears
    assert all(
        hasattr(m, "_leyline_packed") for m in eng.model.modules() if type(m) is torch.nn.Linear
    )
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, eng.vocab_size, (20 + 3 * k,), generator=g).tolist() for k in range(8)]
    r = eng.runner
    batch = _decode_batch(r, seqs)
    out = r.run(batch)  # eight rows per linear: the packed path
    with torch.inference_mode():
        for k, ids in enumerate(seqs):
            truth = ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            assert (out[k] - truth).abs().max() <= TOL, k


@pytest.mark.parametrize("arch", ["deepseek_v2", "llama"])
def test_a_bf16_decode_on_the_skinny_kernel_is_as_close_to_fp32_as_transformers(arch, monkeypatch):
    """bf16 decode steps of one and of three sequences (kernels/skinny_linear.c: every
    nn.Linear, 1 and 3 rows) against an fp32 forward of the same bf16 weights: no further off
    than transformers' own bf16 forward of the whole sequence is."""
    calls = []
    real = skinny_linear.linear

    def spy(x, w, b=None):
        calls.append(x.numel() // x.shape[-1])
        return real(x, w, b)

    monkeypatch.setattr(skinny_linear, "linear", spy)
    eng = Engine.from_pretrained(tiny_model_dir(arch), dtype="bfloat16")
    hf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.bfloat16)
    hf32 = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.bfloat16)
    hf32 = hf32.float().eval()
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, eng.vocab_size, (30 + 7 * k,), generator=g).tolist() for k in range(3)]
    r = eng.runner
    batch = _decode_batch(r, seqs)
    for step in (batch[:1], batch):
        calls.clear()
        out = r.run(step)
        assert calls and set(calls) == {len(step)}  # every linear of the step took the kernel
        with torch.inference_mode():
            for k in range(len(step)):
                x = torch.tensor([seqs[k]])
                truth = hf32(input_ids=x, use_cache=False).logits[0, -1]
                theirs = hf16(input_ids=x, use_cache=False).logits[0, -1].float()
                ours = (out[k] - truth).abs().max()
                assert ours <= 1.5 * (theirs - truth).abs().max() + 1e-3, (k, ours)
