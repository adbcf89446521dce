"""Hugging Face configs for the RoPE kernel tests and the kernel benchmark.

Tiny attention shapes (``mla_dims``: DeepSeek MLA with a 64-wide k_pe band; ``gqa_dims``:
Llama-style grouped-query heads) and the ``rope_parameters`` of real checkpoints (DeepSeek's
YaRN, Llama 3). Every builder returns a fresh object: configs and dicts are mutable.
No torch here; transformers' config classes only.
"""

from __future__ import annotations

from typing import Any

from transformers import DeepseekV2Config, DeepseekV3Config

__all__ = [
    "DEEPSEEK_MAX_POSITIONS",
    "deepseek_v2_lite_yarn",
    "deepseek_v2_yarn",
    "deepseek_v3_interleaved_yarn",
    "deepseek_yarn",
    "gqa_dims",
    "llama3_rope",
    "mla_dims",
]

DEEPSEEK_MAX_POSITIONS = 163840  # DeepSeek-V2/V3: 4096 original positions x YaRN factor 40


def mla_dims(**overrides: Any) -> dict[str, Any]:
    """Tiny MLA attention: 4 heads, kv_lora_rank 64, k_pe (rope) width 64."""
    dims: dict[str, Any] = dict(
        hidden_size=256,
        num_attention_heads=4,
        kv_lora_rank=64,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
    )
    return dims | overrides


def gqa_dims(**overrides: Any) -> dict[str, Any]:
    """Tiny grouped-query attention: 4 query heads over 2 key/value heads of width 64."""
    return dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2) | overrides


def deepseek_yarn(
    mscale: float = 0.707, mscale_all_dim: float = 0.707, *, betas: bool = True
) -> dict[str, Any]:
    """DeepSeek's YaRN ``rope_parameters`` (factor 40 over 4096 positions).

    ``betas=False`` leaves ``beta_fast``/``beta_slow`` to transformers' defaults.
    """
    rope: dict[str, Any] = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
    )
    if betas:
        rope |= dict(beta_fast=32, beta_slow=1)
    return rope | dict(mscale=mscale, mscale_all_dim=mscale_all_dim)


def llama3_rope(original_max_position_embeddings: int = 8192) -> dict[str, Any]:
    """Llama 3.1's ``rope_parameters`` (theta 5e5, factor 8, low/high frequency factors 1/4)."""
    return dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=original_max_position_embeddings,
    )


def deepseek_v2_yarn(
    mscale: float = 0.707, mscale_all_dim: float = 0.707, *, betas: bool = True, **dims: Any
) -> DeepseekV2Config:
    """A DeepSeek-V2 config with YaRN; ``mla_dims`` unless ``dims`` override them."""
    return DeepseekV2Config(
        **mla_dims(max_position_embeddings=DEEPSEEK_MAX_POSITIONS, **dims),
        rope_parameters=deepseek_yarn(mscale, mscale_all_dim, betas=betas),
    )


def deepseek_v3_interleaved_yarn() -> DeepseekV3Config:
    """A DeepSeek-V3 config with ``rope_interleave=True`` and YaRN (mscale 1, 1)."""
    return DeepseekV3Config(
        **mla_dims(max_position_embeddings=DEEPSEEK_MAX_POSITIONS),
        rope_interleave=True,
        rope_parameters=deepseek_yarn(1.0, 1.0),
    )


def deepseek_v2_lite_yarn() -> DeepseekV2Config:
    """DeepSeek-V2-Lite's attention and RoPE settings (latent 512, k_pe 64, 16 heads): the
    ``mla_dims`` widths, scaled up."""
    return deepseek_v2_yarn(
        hidden_size=2048, num_attention_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
        v_head_dim=128,
    )  # fmt: skip
