"""Ground truth for splice tests, built from the model's own modules (never ``rotate_band``).

A ``RefState`` is a token sequence with, per layer, the position-free part of its cache
(MLA: latent ``c_kv``; GQA: values) and the PRE-RoPE rotary part (MLA: ``k_pe`` before
RoPE; GQA: keys before RoPE), captured with forward hooks on the model's own projections.
Its transformers cache is produced by applying the model's own rotary embedding function
at each token's absolute position. Splices on a RefState:

- AMORTIZE(s, e, R): prefix entries kept; R forwarded over the prefix (hooks capture its
  pre-RoPE keys); tail entries keep latent/values and pre-RoPE keys, and get their new
  positions simply by being at index i + delta when the cache is materialized.
- FORGET: R + tail forwarded over the prefix.

This is independent of the runtime's pool, slots and rotation kernel.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

import torch

from leyline_agent.families import is_mla

__all__ = ["RefState", "Row", "cache_from_kv", "greedy_from_kv", "logits_from_kv", "plain_kv"]


def _attn_modules(model):
    return [layer.self_attn for layer in model.model.layers]


def _modeling(model):
    return importlib.import_module(type(model).__module__)


def _is_mla(model) -> bool:
    return is_mla(model.config.model_type)


def cache_from_kv(model, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    if kv[0][0].shape[2] == 0:
        return DynamicCache(config=model.config)
    return DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in kv], config=model.config)


@torch.inference_mode()
def plain_kv(model, token_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) ``[1, H, n, D]`` of a plain prefill of ``token_ids``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([list(token_ids)]), past_key_values=cache, use_cache=True)
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@torch.inference_mode()
def logits_from_kv(model, kv, next_ids: Sequence[int]) -> torch.Tensor:
    cache = cache_from_kv(model, kv)
    out = model(input_ids=torch.tensor([list(next_ids)]), past_key_values=cache, use_cache=True)
    return out.logits[0, -1].float()


@torch.inference_mode()
def greedy_from_kv(model, kv, next_ids: Sequence[int], n: int) -> list[int]:
    cache = cache_from_kv(model, kv)
    ids, out = list(next_ids), []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
        tok = int(torch.argmax(logits[0, -1]))
        out.append(tok)
        ids = [tok]
    return out


def apply_model_rope(model, pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys from pre-RoPE ``pre`` ``[1, H, n, D]`` with the model's own functions."""
    mod = _modeling(model)
    pos = positions.view(1, -1)
    pe = model.model.rotary_emb(pre, pos)
    mt = model.config.model_type
    if mt == "deepseek_v2":
        return mod.apply_rotary_emb(pre, pre, pe)[1]
    cos, sin = pe
    if mt == "deepseek_v3" and model.config.rope_interleave:
        return mod.apply_rotary_pos_emb_interleave(pre, pre, cos, sin)[1]
    return mod.apply_rotary_pos_emb(pre, pre, cos, sin)[1]


@dataclass(eq=False)
class Row:
    """One cached position, position-free: per layer the plain part (MLA latent / GQA
    values) and the PRE-RoPE rotary part, each ``[1, H, 1, D]``. Identity matters to
    ``cache_oracle``: a row reused as it is is the same object."""

    plain: list[torch.Tensor]
    pre: list[torch.Tensor]


@dataclass
class RefState:
    model: object
    tokens: list[int]
    plain: list[torch.Tensor]  # per layer [1, H, n, D]: MLA latent / GQA values
    pre: list[torch.Tensor]  # per layer [1, H, n, D]: pre-RoPE k_pe / keys

    @classmethod
    def prefill(cls, model, token_ids: Sequence[int]) -> RefState:
        empty = cls(model, [], [], [])
        return empty._forward_over(0, list(token_ids))

    @classmethod
    def from_rows(cls, model, tokens: Sequence[int], rows: Sequence[Row]) -> RefState:
        """The state whose position ``i`` holds ``rows[i]`` (positions follow the index)."""
        if not rows:
            return cls(model, [], [], [])
        n_layers = len(rows[0].plain)
        plain = [torch.cat([r.plain[i] for r in rows], dim=2) for i in range(n_layers)]
        pre = [torch.cat([r.pre[i] for r in rows], dim=2) for i in range(n_layers)]
        return cls(model, list(tokens), plain, pre)

    def rows(self, lo: int = 0, hi: int | None = None) -> list[Row]:
        """Fresh ``Row`` objects for positions ``[lo, hi)`` (position-free contents)."""
        hi = len(self.tokens) if hi is None else hi
        return [
            Row([p[:, :, i : i + 1] for p in self.plain], [p[:, :, i : i + 1] for p in self.pre])
            for i in range(lo, hi)
        ]

    def extend(self, new: Sequence[int]) -> RefState:
        """``new`` forwarded after the whole state."""
        return self._forward_over(len(self.tokens), list(new))

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pos = torch.arange(len(self.tokens))
        out = []
        for plain, pre in zip(self.plain, self.pre, strict=True):
            rot = apply_model_rope(self.model, pre, pos)
            out.append((plain, rot) if _is_mla(self.model) else (rot, plain))
        return out

    @torch.inference_mode()
    def _forward_over(self, s: int, new: list[int]) -> RefState:
        """State of ``tokens[:s] + new``: ``new`` forwarded over this state's prefix."""
        model, mla = self.model, _is_mla(self.model)
        prefix = RefState(
            model,
            self.tokens[:s],
            [p[:, :, :s] for p in self.plain],
            [p[:, :, :s] for p in self.pre],
        )
        kv = prefix.kv() if s else None
        captured: list[torch.Tensor] = []
        hooks = []
        cfg = model.config
        for attn in _attn_modules(model):
            if mla:
                r = cfg.kv_lora_rank

                def hook(_m, _i, out, r=r):
                    captured.append(out[..., r:].unsqueeze(1))

                hooks.append(attn.kv_a_proj_with_mqa.register_forward_hook(hook))
            elif hasattr(attn, "k_norm"):

                def hook(_m, _i, out):
                    captured.append(out.transpose(1, 2))

                hooks.append(attn.k_norm.register_forward_hook(hook))
            else:
                hd = attn.head_dim

                def hook(_m, _i, out, hd=hd):
                    b, n, _ = out.shape
                    captured.append(out.view(b, n, -1, hd).transpose(1, 2))

                hooks.append(attn.k_proj.register_forward_hook(hook))
        try:
            from transformers import DynamicCache

            cache = cache_from_kv(model, kv) if kv else DynamicCache(config=cfg)
            if new:
                model(input_ids=torch.tensor([new]), past_key_values=cache, use_cache=True)
        finally:
            for h in hooks:
                h.remove()
        plain, pre = [], []
        for i, layer in enumerate(cache.layers if new else []):
            rows = (layer.keys if mla else layer.values)[:, :, s:]
            plain.append(torch.cat([prefix.plain[i], rows], dim=2) if s else rows.clone())
            pre.append(torch.cat([prefix.pre[i], captured[i]], dim=2) if s else captured[i].clone())
        if not new:
            plain, pre = prefix.plain, prefix.pre
        return RefState(model, self.tokens[:s] + new, plain, pre)

    def amortize(self, s: int, e: int, r: Sequence[int]) -> RefState:
        head = self._forward_over(s, list(r))
        return RefState(
            self.model,
            head.tokens + self.tokens[e:],
            [
                torch.cat([h, p[:, :, e:]], dim=2)
                for h, p in zip(head.plain, self.plain, strict=True)
            ],
            [torch.cat([h, p[:, :, e:]], dim=2) for h, p in zip(head.pre, self.pre, strict=True)],
        )

    def forget(self, s: int, e: int, r: Sequence[int]) -> RefState:
        return self._forward_over(s, list(r) + self.tokens[e:])

    def recompute(self, rows: Sequence[int]) -> RefState:
        """REPAIR's rows recomputed in place: each run ``[a, b)`` of consecutive ``rows``,
        left to right, forwarded again over this state's rows before it (those already
        recomputed included), the rows after it kept as they are."""
        state = self
        ordered = sorted(set(rows))
        for _, run in groupby(enumerate(ordered), key=lambda ir: ir[1] - ir[0]):
            idx = [r for _, r in run]
            a, b = idx[0], idx[-1] + 1
            head = state._forward_over(a, state.tokens[a:b])
            plain = [
                torch.cat([h, p[:, :, b:]], dim=2)
                for h, p in zip(head.plain, state.plain, strict=True)
            ]
            pre = [
                torch.cat([h, p[:, :, b:]], dim=2) for h, p in zip(head.pre, state.pre, strict=True)
            ]
            state = RefState(self.model, list(self.tokens), plain, pre)
        return state
