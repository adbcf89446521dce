"""Inverse frequencies of a Hugging Face config, in fp32, computed the way the model does.

Each function below follows the arithmetic of transformers 5.19's rope initialisers
(``modeling_rope_utils.py`` and the models' ``compute_default_rope_parameters``) step by
step in fp32 so the values match the model's ``inv_freq`` buffer bitwise; the tests check
that against the model's own rotary embedding module. Returns ``(inv_freq, attention_scaling)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from leyline_agent.errors import RopeSpecError

# Sequence-length dependent: a δ-rotation of a cached key would not land where a fresh
# prefill puts it.
_REFUSED = {
    "dynamic": "dynamic NTK recomputes inv_freq from the sequence length",
    "proportional": "proportional rope is not supported yet",
}


def rope_parameters(config: Any) -> dict[str, Any]:
    """A flat copy of ``config.rope_parameters`` with rope_type/rope_theta filled in."""
    raw = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rp = dict(raw)
    if any(isinstance(v, dict) for v in rp.values()):
        raise RopeSpecError(
            "config.rope_parameters is nested per layer type; pick one layer type's parameters"
        )
    rp.setdefault("rope_type", rp.get("type", "default"))
    if "rope_theta" not in rp:
        theta = getattr(config, "rope_theta", None)
        if theta is None:
            raise RopeSpecError("config has no rope_theta (in rope_parameters or as attribute)")
        rp["rope_theta"] = theta
    if "partial_rotary_factor" not in rp and getattr(config, "partial_rotary_factor", None):
        rp["partial_rotary_factor"] = config.partial_rotary_factor
    if rp.get("mrope_section") is not None:
        raise RopeSpecError(
            "config.rope_parameters.mrope_section: multimodal rope is not supported"
        )
    return rp


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rotary_dim(config: Any, rp: dict[str, Any]) -> int:
    return int(_head_dim(config) * rp.get("partial_rotary_factor", 1.0))


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (base**exponents)


def _yarn(config: Any, rp: dict[str, Any], truncate: bool | None) -> tuple[torch.Tensor, float]:
    base, dim = rp["rope_theta"], _rotary_dim(config, rp)
    factor = rp.get("factor")
    original_max = rp.get("original_max_position_embeddings")
    if hasattr(config, "original_max_position_embeddings"):
        original_max = config.original_max_position_embeddings
    if original_max is None:
        original_max = config.max_position_embeddings
    if factor is None:
        factor = config.max_position_embeddings / original_max

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rp.get("attention_factor")
    if attention is None:
        m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
        attention = (
            float(mscale_of(factor, m) / mscale_of(factor, m_all))
            if m and m_all
            else mscale_of(factor)
        )
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True) if truncate is None else truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp.to(dtype=torch.float)
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def _llama3(config: Any, rp: dict[str, Any]) -> torch.Tensor:
    inv_freq = _base_inv_freq(rp["rope_theta"], _rotary_dim(config, rp))
    factor, low_f, high_f = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old_len = rp.get("original_max_position_embeddings") or config.max_position_embeddings
    low_wavelen, high_wavelen = old_len / low_f, old_len / high_f
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_f) / (high_f - low_f)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope(config: Any, rp: dict[str, Any]) -> tuple[torch.Tensor, float]:
    short, long = list(rp["short_factor"]), list(rp["long_factor"])
    if short != long:
        raise RopeSpecError(
            "rope_type 'longrope' with short_factor != long_factor switches inv_freq with the "
            "sequence length; a δ-rotation would be inexact (use FORGET)"
        )
    base, dim = rp["rope_theta"], _rotary_dim(config, rp)
    original_max = getattr(config, "original_max_position_embeddings", None) or rp.get(
        "original_max_position_embeddings", config.max_position_embeddings
    )
    factor = rp.get("factor") or config.max_position_embeddings / original_max
    attention = rp.get("attention_factor")
    if attention is None:
        attention = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
        )
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(short, dtype=torch.float32) * base**shape), float(attention)


def compute_inv_freq(
    config: Any, default_honours_partial: bool, truncate: bool | None = None
) -> tuple[torch.Tensor, float, str]:
    """``(inv_freq fp32 [rotary_dim // 2], attention_scaling, rope_type)`` of ``config``.

    ``truncate``: YaRN correction-range truncation; None = the config's ``truncate`` (default
    True, as transformers), a bool forces it (SGLang always truncates).
    """
    rp = rope_parameters(config)
    rope_type = rp["rope_type"]
    if rope_type in _REFUSED or "dynamic" in rope_type:
        reason = _REFUSED.get(rope_type, _REFUSED["dynamic"])
        raise RopeSpecError(
            f"rope_type {rope_type!r}: {reason}; a δ-rotation would be inexact (use FORGET)"
        )
    if rope_type == "default":
        dim = _rotary_dim(config, rp) if default_honours_partial else _head_dim(config)
        return _base_inv_freq(rp["rope_theta"], dim), 1.0, rope_type
    if rope_type == "linear":
        inv_freq = _base_inv_freq(rp["rope_theta"], _rotary_dim(config, rp))
        inv_freq /= rp["factor"]
        return inv_freq, 1.0, rope_type
    if rope_type == "llama3":
        return _llama3(config, rp), 1.0, rope_type
    if rope_type == "yarn":
        inv_freq, attention = _yarn(config, rp, truncate)
        return inv_freq, attention, rope_type
    if rope_type == "longrope":
        inv_freq, attention = _longrope(config, rp)
        return inv_freq, attention, rope_type
    raise RopeSpecError(f"rope_type {rope_type!r} is not supported")
