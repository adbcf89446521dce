"""δ-rotation exactness against RoPE from scratch in float64, checked against transformers.

For each model family the yardstick is ``rope_float64`` fed with the frequencies and the
magnitude of the model's OWN rotary module (not ours) and the pair layout read from its code;
``test_reference_matches_transformers`` checks that yardstick against transformers' own fp32
RoPE at small positions (where fp32 is accurate). Then a unit-scale key cached at position i
(up to 8k) and rotated by Δ must equal the float64 key at i + Δ within 5e-5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import GlmConfig, LlamaConfig, Phi3Config, Qwen3Config
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3
from transformers.models.glm import modeling_glm as glm
from transformers.models.llama import modeling_llama as llama
from transformers.models.phi3 import modeling_phi3 as phi3
from transformers.models.qwen3 import modeling_qwen3 as qwen3

from leyline_agent.kernels import RopeSpec, band_offset_for, rotate_band
from leyline_agent.kernels.reference import rope_float64
from leyline_agent.reference.rope_configs import (
    deepseek_v2_yarn,
    deepseek_v3_interleaved_yarn,
    gqa_dims,
    llama3_rope,
)

DELTAS = [-1024, -129, -128, -127, -1, 0, 1, 127, 128, 129, 1024]
POSITIONS = [0, 3, 128, 1025, 2048, 4097, 6000, 8191]
TOL = 5e-5


def _ds2_apply(emb, k, pos):
    return ds2.apply_rotary_emb(k, k, emb(k, pos[None]))[1]


def _ds3_apply(emb, k, pos):
    # rope_interleave reads adjacent pairs of the projected key and caches cat([even', odd']):
    # feed it the interleaved form of the half-split key the yardstick rotates.
    k = torch.stack((k[..., :32], k[..., 32:]), dim=-1).flatten(-2)
    cos, sin = emb(k, pos[None])
    return ds3.apply_rotary_pos_emb_interleave(k, k, cos, sin)[1]


def _std_apply(module):
    def apply(emb, k, pos):
        cos, sin = emb(k, pos[None])
        return module.apply_rotary_pos_emb(k, k, cos, sin)[1]

    return apply


@dataclass
class Case:
    name: str
    config: Any
    rotary_cls: Any
    hf_apply: Any
    layout: str  # read from the model's code (see kernels/rope_spec.py)
    heads: int  # cached key heads
    width: int  # cached key width (k_pe width for MLA, head_dim otherwise)


CASES = [
    Case(
        "deepseek_v2_yarn",
        deepseek_v2_yarn(0.707, 0.707),
        ds2.DeepseekV2RotaryEmbedding,
        _ds2_apply,
        "interleaved",
        1,
        64,
    ),
    Case(  # mscale != mscale_all_dim: attention scaling 1.369 lives in the cached key
        "deepseek_v2_yarn_mscale",
        deepseek_v2_yarn(1.0, 0.0),
        ds2.DeepseekV2RotaryEmbedding,
        _ds2_apply,
        "interleaved",
        1,
        64,
    ),
    Case(
        "deepseek_v3_rope_interleave",
        deepseek_v3_interleaved_yarn(),
        ds3.DeepseekV3RotaryEmbedding,
        _ds3_apply,
        "half",
        1,
        64,
    ),
    Case(
        "llama3",
        LlamaConfig(**gqa_dims(), max_position_embeddings=131072, rope_parameters=llama3_rope()),
        llama.LlamaRotaryEmbedding,
        _std_apply(llama),
        "half",
        2,
        64,
    ),
    Case(
        "qwen3",
        Qwen3Config(
            **gqa_dims(head_dim=128), rope_parameters=dict(rope_type="default", rope_theta=1e6)
        ),
        qwen3.Qwen3RotaryEmbedding,
        _std_apply(qwen3),
        "half",
        2,
        128,
    ),
    Case(  # Phi-4-mini style: rotary on the first 75% of each key head, rest passes through
        "phi3_partial",
        Phi3Config(**gqa_dims(), partial_rotary_factor=0.75),
        phi3.Phi3RotaryEmbedding,
        _std_apply(phi3),
        "half",
        2,
        64,
    ),
    Case(  # GLM: partial (first half of the head) AND interleaved pairs
        "glm_partial_interleaved",
        GlmConfig(**gqa_dims(head_dim=64), partial_rotary_factor=0.5),
        glm.GlmRotaryEmbedding,
        _std_apply(glm),
        "interleaved",
        2,
        64,
    ),
]


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def case(request) -> Case:
    return request.param


def _keys(case: Case, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(case.heads, case.width, generator=g, dtype=torch.float64) * 2 - 1


def test_inv_freq_and_scaling_match_the_model(case: Case):
    emb = case.rotary_cls(case.config)
    spec = RopeSpec.from_hf_config(case.config)
    assert torch.equal(spec.inv_freq_tensor(), emb.inv_freq)  # bitwise, fp32
    assert spec.attention_scaling == pytest.approx(emb.attention_scaling, rel=1e-12)
    assert spec.rotary_dim == 2 * emb.inv_freq.numel()
    assert spec.layout == case.layout


def test_reference_matches_transformers(case: Case):
    """The float64 yardstick (model's frequencies, magnitude, layout) equals HF's fp32 RoPE."""
    emb = case.rotary_cls(case.config)
    keys = _keys(case)
    pos = torch.arange(64)
    k4 = keys.float()[None, :, None, :].expand(1, case.heads, pos.numel(), case.width).contiguous()
    hf = case.hf_apply(emb, k4, pos)[0]  # [heads, seq, width]
    for h in range(case.heads):
        ref = rope_float64(keys[h], pos, emb.inv_freq, case.layout, 0, emb.attention_scaling)
        # fp32 angle error at position < 64 is ~64 * 2**-24 rad: 1e-5 still catches
        # any layout or magnitude mistake (those are O(1)).
        torch.testing.assert_close(hf[h].double(), ref, atol=1e-5, rtol=0)
    # The scaled cases really exercise the magnitude.
    if case.name == "deepseek_v2_yarn_mscale":
        assert emb.attention_scaling == pytest.approx(1.3688879, rel=1e-6)


def _pairs():
    return [(i, d) for i in POSITIONS for d in DELTAS if i + d >= 0]


@pytest.mark.parametrize("backend", ["torch", "triton", "c"])
@pytest.mark.parametrize("mode", ["in_place", "copy", "overlap"])
def test_delta_rotation_is_exact(case: Case, backend: str, mode: str):
    emb = case.rotary_cls(case.config)
    spec = RopeSpec.from_hf_config(case.config)
    keys, pairs = _keys(case, seed=1), _pairs()
    pos = torch.tensor([i for i, _ in pairs])
    delta = torch.tensor([d for _, d in pairs])
    n = len(pairs)
    # transformers layout: [batch, heads, seq, width], 2n rows so "copy" has room.
    cached = torch.stack(
        [
            rope_float64(keys[h], pos, emb.inv_freq, case.layout, 0, emb.attention_scaling)
            for h in range(case.heads)
        ]
    )
    buffer = torch.zeros(1, case.heads, 2 * n, case.width)
    buffer[0, :, :n] = cached.float()
    before = buffer.clone()
    src = torch.arange(n)
    dst = {"in_place": src, "copy": src + n, "overlap": src.flip(0)}[mode]
    rotate_band(buffer, src, dst, delta, spec, band_offset_for(case.config), backend=backend)

    expected = torch.stack(
        [
            rope_float64(keys[h], pos + delta, emb.inv_freq, case.layout, 0, emb.attention_scaling)
            for h in range(case.heads)
        ]
    )
    got = buffer[0][:, dst]
    err = (got.double() - expected).abs().max().item()
    assert err <= TOL, f"{case.name}: max abs error {err:.3g} > {TOL}"
    # Pass-through columns (partial rotary) are the source's bytes, bitwise.
    rd = spec.rotary_dim
    assert torch.equal(got[..., rd:], before[0][:, src][..., rd:])
    if mode == "copy":  # source rows untouched
        assert torch.equal(buffer[0, :, :n], before[0, :, :n])


@pytest.mark.parametrize("backend", ["torch", "triton", "c"])
def test_sglang_mla_pool_row(backend: str):
    """SGLang's MLA pool row [latent | k_pe], interleaved, band at kv_lora_rank, strided view."""
    config = deepseek_v3_interleaved_yarn()
    spec = RopeSpec.from_hf_config(config, cache_owner="sglang")
    offset = band_offset_for(config, "sglang")
    assert (spec.layout, offset) == ("interleaved", config.kv_lora_rank)
    emb = ds3.DeepseekV3RotaryEmbedding(config)  # frequencies/magnitude; layout is SGLang's
    g = torch.Generator().manual_seed(2)
    row = torch.rand(offset + 64, generator=g, dtype=torch.float64) * 2 - 1
    pairs = _pairs()
    pos = torch.tensor([i for i, _ in pairs])
    delta = torch.tensor([d for _, d in pairs])
    n = len(pairs)
    pool = torch.zeros(2 * n + 1, 1, offset + 64)  # SGLang: [slots, 1, kv_lora_rank + rope]
    pool[1 : n + 1, 0] = rope_float64(row, pos, emb.inv_freq, "interleaved", offset).float()
    before = pool.clone()
    src, dst = torch.arange(1, n + 1), torch.arange(n + 1, 2 * n + 1)
    rotate_band(pool.transpose(0, 1), src, dst, delta, spec, offset, backend=backend)
    expected = rope_float64(row, pos + delta, emb.inv_freq, "interleaved", offset)
    assert (pool[dst, 0].double() - expected).abs().max().item() <= TOL
    assert torch.equal(pool[dst, 0, :offset], before[src, 0, :offset])  # latent copied bitwise
    assert torch.equal(pool[: n + 1], before[: n + 1])


@pytest.mark.parametrize("backend", ["torch", "triton", "c"])
def test_large_delta_keeps_fp64_angle_accuracy(backend: str):
    """|Δ| ~ 1e5..1e6: an fp32 angle would be off by up to ~3e-2 rad; ours stays exact."""
    case = CASES[3]  # llama3: inv_freq[0] = 1, the worst case for angle rounding
    emb = case.rotary_cls(case.config)
    spec = RopeSpec.from_hf_config(case.config)
    keys = _keys(case, seed=3)
    pos = torch.tensor([5, 8191, 1_000_000, 700_001])
    delta = torch.tensor([100_003, 999_999, -999_999, -654_321])
    buffer = torch.stack(
        [rope_float64(keys[h], pos, emb.inv_freq, "half") for h in range(case.heads)]
    ).float()
    rotate_band(buffer, torch.arange(4), torch.arange(4), delta, spec, backend=backend)
    expected = torch.stack(
        [rope_float64(keys[h], pos + delta, emb.inv_freq, "half") for h in range(case.heads)]
    )
    assert (buffer.double() - expected).abs().max().item() <= TOL
