"""RopeSpec.from_hf_config: frequencies vs the models' own modules, layouts, refusals."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pydantic
import pytest
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    GPT2Config,
    LlamaConfig,
    Phi3Config,
    Qwen3Config,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from leyline_agent.errors import RopeSpecError
from leyline_agent.kernels import RopeSpec, band_offset_for
from leyline_agent.kernels.reference import rope_float64
from leyline_agent.reference.rope_configs import deepseek_v2_yarn, gqa_dims, llama3_rope, mla_dims


def test_linear_scaling_matches_llama_module():
    config = LlamaConfig(
        **gqa_dims(), rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=1e4)
    )
    spec = RopeSpec.from_hf_config(config)
    assert torch.equal(spec.inv_freq_tensor(), LlamaRotaryEmbedding(config).inv_freq)
    assert (spec.rope_type, spec.layout, spec.rotary_dim) == ("linear", "half", 64)


def test_plain_yarn_matches_qwen3_module():
    config = Qwen3Config(
        **gqa_dims(),
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="yarn", factor=4.0, rope_theta=1e6, original_max_position_embeddings=32768
        ),
    )
    emb = Qwen3RotaryEmbedding(config)
    spec = RopeSpec.from_hf_config(config)
    assert torch.equal(spec.inv_freq_tensor(), emb.inv_freq)
    assert spec.attention_scaling == pytest.approx(emb.attention_scaling) != 1.0


def test_static_longrope_matches_phi3_module():
    factors = [1.0 + 0.05 * j for j in range(24)]  # rotary_dim 48 (partial 0.75 of 64)
    config = Phi3Config(
        **gqa_dims(),
        partial_rotary_factor=0.75,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_parameters=dict(
            rope_type="longrope", rope_theta=1e4, short_factor=factors, long_factor=factors
        ),
    )
    emb = Phi3RotaryEmbedding(config)
    spec = RopeSpec.from_hf_config(config)
    assert torch.equal(spec.inv_freq_tensor(), emb.inv_freq)
    assert spec.rotary_dim == 48
    assert spec.attention_scaling == pytest.approx(emb.attention_scaling)


def test_sequence_length_dependent_frequencies_are_refused():
    dynamic = LlamaConfig(
        **gqa_dims(), rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)
    )
    with pytest.raises(RopeSpecError, match="dynamic"):
        RopeSpec.from_hf_config(dynamic)
    longrope = Phi3Config(
        **gqa_dims(),
        partial_rotary_factor=0.75,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_parameters=dict(
            rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 24, long_factor=[4.0] * 24
        ),
    )
    with pytest.raises(RopeSpecError, match="longrope"):
        RopeSpec.from_hf_config(longrope)


def test_unknown_or_nested_configs_are_refused():
    with pytest.raises(RopeSpecError, match="model_type='gpt2'"):
        RopeSpec.from_hf_config(GPT2Config())
    nested = SimpleNamespace(
        model_type="llama",
        rope_parameters={
            "full_attention": {"rope_theta": 1e4},
            "sliding_attention": {"rope_theta": 1e4},
        },
    )
    with pytest.raises(RopeSpecError, match="nested"):
        RopeSpec.from_hf_config(nested)
    llama3 = LlamaConfig(**gqa_dims(), rope_parameters=llama3_rope(1024))
    with pytest.raises(RopeSpecError, match="sglang"):
        RopeSpec.from_hf_config(llama3, cache_owner="sglang")
    with pytest.raises(ValueError, match="cache_owner"):
        RopeSpec.from_hf_config(llama3, cache_owner="vllm")


def _sglang_neox_rule() -> str:
    import sglang

    src = Path(inspect.getfile(sglang)).parent / "srt" / "models" / "deepseek_v2.py"
    return src.read_text()


@pytest.mark.parametrize("rope_interleave", [True, False, None])
def test_sglang_deepseek_layout_matches_sglang_rotation(rope_interleave):
    """SGLang decides GPT-J vs NeoX from rope_interleave; its own apply_rotary_emb then writes
    the cached k_pe. Our spec's layout must describe exactly what it wrote."""
    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb

    assert 'is_neox_style = not getattr(config, "rope_interleave", True)' in _sglang_neox_rule()
    kwargs = {} if rope_interleave is None else {"rope_interleave": rope_interleave}
    cls = DeepseekV2Config if rope_interleave is None else DeepseekV3Config
    config = cls(**mla_dims(), **kwargs)
    spec = RopeSpec.from_hf_config(config, cache_owner="sglang")
    is_neox = not getattr(config, "rope_interleave", True)
    assert spec.layout == ("half" if is_neox else "interleaved")
    assert band_offset_for(config, "sglang") == 64 and band_offset_for(config) == 0

    key = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(50)
    angle = pos[:, None].double() * spec.inv_freq_tensor().double()[None, :]
    theirs = apply_rotary_emb(key.expand(50, 1, 64), angle.cos(), angle.sin(), is_neox)[:, 0]
    ours = rope_float64(key, pos, spec.inv_freq_tensor(), spec.layout)
    torch.testing.assert_close(theirs, ours, atol=1e-12, rtol=0)


def test_gqa_band_offset_is_zero():
    assert band_offset_for(LlamaConfig(**gqa_dims()), "sglang") == 0


def test_spec_is_a_frozen_validated_model():
    spec = RopeSpec(inv_freq=(1.0, 0.5), rotary_dim=4, layout="half")
    with pytest.raises(pydantic.ValidationError):
        spec.layout = "interleaved"
    with pytest.raises(pydantic.ValidationError, match="fp32"):
        RopeSpec(inv_freq=(0.1,), rotary_dim=2, layout="half")  # 0.1 is not an fp32 value
    with pytest.raises(pydantic.ValidationError, match="rotary_dim"):
        RopeSpec(inv_freq=(1.0, 0.5), rotary_dim=6, layout="half")
    with pytest.raises(pydantic.ValidationError):
        RopeSpec(inv_freq=(1.0,), rotary_dim=2, layout="half", mscale=1.0)
    with pytest.raises(pydantic.ValidationError):
        RopeSpec(inv_freq=(1.0,), rotary_dim=2, layout="adjacent")
    assert hash(spec) == hash(RopeSpec.model_validate_json(spec.model_dump_json()))


@pytest.mark.parametrize("mscale,mscale_all_dim", [(0.707, 0.707), (1.0, 0.0)])
def test_sglang_deepseek_frequencies_match_sglang(mscale, mscale_all_dim):
    """SGLang turns any DeepSeek rope_scaling into its own YaRN (DeepseekScalingRotaryEmbedding);
    run its frequency method (on a plain namespace: the class needs CUDA kernels to build)."""
    from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding
    from sglang.srt.layers.rotary_embedding.yarn import yarn_get_mscale

    config = deepseek_v2_yarn(mscale, mscale_all_dim)
    spec = RopeSpec.from_hf_config(config, cache_owner="sglang")
    ns = SimpleNamespace(
        base=10000.0,
        rotary_dim=64,
        device="cpu",
        beta_fast=32,
        beta_slow=1,
        max_position_embeddings=4096,  # SGLang passes original_max_position_embeddings here
        extrapolation_factor=1,
    )
    theirs = DeepseekScalingRotaryEmbedding._compute_inv_freq(ns, 40.0)
    assert torch.equal(spec.inv_freq_tensor(), theirs)
    their_mscale = yarn_get_mscale(40.0, mscale) / yarn_get_mscale(40.0, mscale_all_dim)
    assert spec.attention_scaling == pytest.approx(their_mscale, rel=1e-12)
