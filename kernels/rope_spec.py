"""RopeSpec: everything a δ-rotation of cached keys needs, read from a Hugging Face config.

A cached post-RoPE key of the token at position ``i`` is ``s · R(i·θ) · k`` where ``θ`` are
the model's inverse frequencies (``inv_freq``, fp32 as the model computes them) and ``s``
is the model's attention scaling (YaRN ``mscale``; already inside the cached key). Moving the
key to position ``i + Δ`` is the pure rotation ``R(Δ·θ)`` (unit magnitude): ``s`` must not be
applied again, so :class:`RopeSpec` records it (``attention_scaling``) but the kernels never
use it.

The pair layout of the *cached* key belongs to the engine that wrote it:

==================  =====================  ==========================================
model_type          cache_owner            layout of the rotary band
==================  =====================  ==========================================
deepseek_v2         transformers           interleaved (complex view of adjacent pairs)
deepseek_v3         transformers           half (``rope_interleave`` writes
                                           ``cat([even', odd'])``; without it,
                                           ``rotate_half``)
deepseek_v2/v3      sglang                 interleaved (GPT-J: ``is_neox_style =
                                           not rope_interleave``, default True);
                                           half when ``rope_interleave=False``
glm, glm4           transformers           interleaved, partial (first rotary_dim dims)
llama, mistral,     transformers, sglang   half (``rotate_half`` / NeoX)
qwen2(_moe),
qwen3(_moe), phi3,
stablelm, gpt_neox
==================  =====================  ==========================================

The table is ``leyline_agent.families`` (``rope_layout``, ``rope_partial``, ``sglang_rope``).

Where the band sits in a cache row (``band_offset`` for ``rotate_band``), see
:func:`band_offset_for`: transformers caches DeepSeek's ``k_pe`` alone in
``cache.layers[i].values`` (``[b, 1, seq, qk_rope_head_dim]``, offset 0); SGLang's MLA pool
row is ``[latent kv_lora_rank | k_pe qk_rope_head_dim]`` (offset ``kv_lora_rank``); GQA/MHA
caches hold full keys ``[b, kv_heads, seq, head_dim]`` with the band first (offset 0).

Frequencies that change with the sequence length (dynamic NTK, LongRoPE with distinct
short/long factors) make a δ-rotation inexact: :meth:`RopeSpec.from_hf_config` refuses them
with :class:`~leyline_agent.errors.RopeSpecError`, so callers fall back to FORGET.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from leyline_agent.errors import RopeSpecError
from leyline_agent.families import FAMILIES, family, is_mla

Layout = Literal["interleaved", "half"]
CacheOwner = Literal["transformers", "sglang"]


def _is_fp32(x: float) -> bool:
    return math.isfinite(x) and struct.unpack("f", struct.pack("f", x))[0] == x


class RopeSpec(BaseModel):
    """A frozen description of one model's rotary band, as its cache stores it.

    ``inv_freq`` holds the fp32 values (exactly, as Python floats) that the model multiplies
    positions by; ``rotary_dim == 2 * len(inv_freq)``; ``layout`` says how the band's pairs
    are laid out: ``interleaved`` = ``(x0, x1), (x2, x3), ...``, ``half`` = ``(x_j,
    x_{j + rotary_dim/2})``. ``attention_scaling`` is informational (see module docstring).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    inv_freq: tuple[float, ...]
    rotary_dim: int
    layout: Layout
    rope_type: str = "default"
    attention_scaling: float = 1.0
    model_type: str | None = None
    cache_owner: CacheOwner = "transformers"

    @field_validator("inv_freq")
    @classmethod
    def _fp32_values(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if not v:
            raise ValueError("inv_freq must not be empty")
        for j, f in enumerate(v):
            if not _is_fp32(f):
                raise ValueError(f"inv_freq[{j}]={f!r} is not a finite fp32 value")
        return v

    @model_validator(mode="after")
    def _dim_matches(self) -> RopeSpec:
        if self.rotary_dim != 2 * len(self.inv_freq):
            raise ValueError(
                f"rotary_dim={self.rotary_dim} must equal 2 * len(inv_freq) = {2 * len(self.inv_freq)}"
            )
        return self

    @property
    def half(self) -> int:
        """Number of rotary pairs (``rotary_dim // 2``)."""
        return len(self.inv_freq)

    def inv_freq_tensor(self, device: Any = "cpu") -> Any:
        """``inv_freq`` as an fp32 torch tensor on ``device`` (cached: do not modify it)."""
        return _inv_freq_on(self.inv_freq, str(device))

    @classmethod
    def from_hf_config(cls, config: Any, cache_owner: CacheOwner = "transformers") -> RopeSpec:
        """Build the spec of ``config``'s rotary band as ``cache_owner``'s KV cache stores it.

        Raises :class:`RopeSpecError` for unknown model types, per-layer (nested) rope
        parameters and frequencies that depend on the sequence length.
        """
        from leyline_agent.kernels.inv_freq import compute_inv_freq

        layout, honours_partial = _layout_for(config, cache_owner)
        # SGLang's YaRN always truncates the correction range (yarn_find_correction_range);
        # transformers follows the config's `truncate`.
        inv_freq, attention, rope_type = compute_inv_freq(
            config, honours_partial, truncate=True if cache_owner == "sglang" else None
        )
        if cache_owner == "sglang" and rope_type not in ("default", "yarn"):
            raise RopeSpecError(
                f"rope_type {rope_type!r} with cache_owner='sglang': SGLang's frequencies for it "
                "have not been checked against this implementation"
            )
        values = tuple(float(f) for f in inv_freq.tolist())
        return cls(
            inv_freq=values,
            rotary_dim=2 * len(values),
            layout=layout,
            rope_type=rope_type,
            attention_scaling=attention,
            model_type=config.model_type,
            cache_owner=cache_owner,
        )


@functools.lru_cache(maxsize=64)
def _inv_freq_on(values: tuple[float, ...], device: str) -> Any:
    import torch

    return torch.tensor(values, dtype=torch.float32, device=device)


def _layout_for(config: Any, cache_owner: str) -> tuple[Layout, bool]:
    model_type = getattr(config, "model_type", None)
    row = family(model_type)
    if cache_owner == "transformers":
        if row is None:
            raise RopeSpecError(
                f"config.model_type={model_type!r}: no known transformers cache layout "
                f"(known: {sorted(FAMILIES)})"
            )
        return row.rope_layout, row.rope_partial
    if cache_owner == "sglang":
        if row is not None and row.sglang_rope == "config":
            # SGLang 0.5.23 deepseek_v2.py: is_neox_style = not getattr(config, "rope_interleave", True)
            neox = not getattr(config, "rope_interleave", True)
            return ("half" if neox else "interleaved"), False
        if row is not None and row.sglang_rope == "half":
            return "half", False
        known = sorted(f.model_type for f in FAMILIES.values() if f.sglang_rope is not None)
        raise RopeSpecError(
            f"config.model_type={model_type!r}: no known SGLang cache layout (known: {known})"
        )
    raise ValueError(f"cache_owner={cache_owner!r} must be 'transformers' or 'sglang'")


def band_offset_for(config: Any, cache_owner: CacheOwner = "transformers") -> int:
    """Offset of the rotary band inside one cache row of ``cache_owner``'s KV cache.

    * transformers, DeepSeek MLA: the row is ``cache.layers[i].values[b, 0, t, :]`` = k_pe
      alone (width ``qk_rope_head_dim``) -> 0.
    * SGLang, DeepSeek MLA: the pool row is ``[latent (kv_lora_rank) | k_pe]`` -> ``kv_lora_rank``.
    * GQA/MHA (both owners): the row is one key head, the band comes first -> 0.
    """
    _layout_for(config, cache_owner)
    if cache_owner == "sglang" and is_mla(getattr(config, "model_type", None)):
        return int(config.kv_lora_rank)
    return 0


def rotation_cos_sin(delta: Any, spec: RopeSpec) -> tuple[Any, Any]:
    """fp32 ``cos, sin`` of ``delta[k] * inv_freq[j]``, shape ``[K, rotary_dim // 2]``.

    The angle is formed and its cos/sin taken in fp64 (exact product, accurate reduction).
    """
    import torch

    inv_freq = spec.inv_freq_tensor(delta.device).to(torch.float64)
    angle = delta.to(torch.float64)[:, None] * inv_freq[None, :]
    return angle.cos().to(torch.float32), angle.sin().to(torch.float32)
