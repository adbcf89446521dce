"""The KV pool: the bytes of every cached token, one row per slot, all layers at once.

Layout mirrors what transformers caches per layer (``cache.layers[i].keys / .values``,
``[batch, heads, seq, dim]``), with the batch dropped and the layers stacked:

- ``keys``   ``[layers, k_heads, slots, k_dim]``
- ``values`` ``[layers, v_heads, slots, v_dim]``

MLA (DeepSeek V2/V3): keys = the normalised latent ``c_kv`` (1 head, kv_lora_rank),
values = the post-RoPE ``k_pe`` (1 head, qk_rope_head_dim): the rotary band is all of
``values``. GQA (Llama, Qwen): keys = post-RoPE keys (kv_heads, head_dim), the band is
their first ``rotary_dim`` columns; values carry no position.

So the rotated tensor has shape ``(*lead, rows, width)`` with rows = slots and
``rotate_band`` applies to it directly, every layer and head in one call.
The pool knows nothing of trees or tokens: callers pass slot indices.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from leyline_agent.families import is_mla

__all__ = ["KVLayout", "KVPool", "slot_tensor"]


@dataclass(slots=True, frozen=True)
class KVLayout:
    kind: Literal["mla", "gqa"]
    num_layers: int
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int

    @property
    def rotated(self) -> Literal["keys", "values"]:
        """Which tensor carries the rotary band (at column 0)."""
        return "values" if self.kind == "mla" else "keys"

    @classmethod
    def from_config(cls, config: Any) -> KVLayout:
        L = config.num_hidden_layers
        if is_mla(config.model_type):
            return cls("mla", L, 1, config.kv_lora_rank, 1, config.qk_rope_head_dim)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        kvh = config.num_key_value_heads
        return cls("gqa", L, kvh, head_dim, kvh, head_dim)


class KVPool:
    def __init__(
        self,
        layout: KVLayout,
        rope_spec: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int = 1024,
    ) -> None:
        self.layout, self.rope_spec = layout, rope_spec
        self.dtype, self.device = dtype, torch.device(device)
        lo = layout
        self.keys = torch.zeros(
            lo.num_layers, lo.k_heads, capacity, lo.k_dim, dtype=dtype, device=device
        )
        self.values = torch.zeros(
            lo.num_layers, lo.v_heads, capacity, lo.v_dim, dtype=dtype, device=device
        )

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def grow(self, min_capacity: int) -> int:
        """Enlarge (at least doubling) so that ``min_capacity`` slots exist; returns capacity."""
        cap = self.capacity
        if min_capacity <= cap:
            return cap
        new = max(min_capacity, 2 * cap)
        self.keys = _extend(self.keys, new)
        self.values = _extend(self.values, new)
        return new

    def shrink(self, capacity: int) -> None:
        """Keep slots ``[0, capacity)`` (their rows unchanged) and free the memory of the rest;
        the caller has made sure no slot at or above ``capacity`` is in use
        (``SlotAllocator.trim``)."""
        if capacity >= self.capacity:
            return
        self.keys = self.keys[:, :, :capacity].clone()
        self.values = self.values[:, :, :capacity].clone()

    def _idx(self, slots: Sequence[int]) -> torch.Tensor:
        return slot_tensor(slots, self.device)

    # ------------------------------------------------------------------ transformers side
    def as_cache_data(self, slots: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``(keys, values)`` ``[1, heads, len(slots), dim]`` copies, in slot order."""
        idx = self._idx(slots)
        k = self.keys.index_select(2, idx)
        v = self.values.index_select(2, idx)
        return [(k[i].unsqueeze(0), v[i].unsqueeze(0)) for i in range(self.layout.num_layers)]

    # ------------------------------------------------------------------ splice side
    def copy_rotated(
        self, src: Sequence[int], dst: Sequence[int], delta: Sequence[int] | int
    ) -> None:
        """Copy rows src -> dst (fresh slots); the rotary band is turned by ``delta`` positions.

        The band goes through ``leyline_agent.kernels.rotate_band``; the position-free tensor
        (MLA latent, GQA values) is copied as is.
        """
        if len(src) != len(dst):
            raise ValueError(f"copy_rotated: {len(src)} sources, {len(dst)} destinations")
        if not src:
            return
        from leyline_agent.kernels import rotate_band

        # the run checks below read the host's copies: on a GPU they would wait for the device
        s_host, d_host = slot_tensor(src), slot_tensor(dst)
        s, d = s_host.to(self.device), d_host.to(self.device)
        if isinstance(delta, int):
            dl = torch.full((len(src),), delta, dtype=torch.long, device=self.device)
        else:
            dl = self._idx(delta)
        rot, plain = (
            (self.values, self.keys)
            if self.layout.rotated == "values"
            else (self.keys, self.values)
        )
        rotate_band(rot, s, d, dl, self.rope_spec, band_offset=0)
        s0, d0 = _run_start(s_host), _run_start(d_host)
        if s0 >= 0 and d0 >= 0:  # one run each (the usual tail -> fresh run): a single copy
            k = len(src)
            if abs(s0 - d0) >= k:  # disjoint (fresh destinations)
                plain.narrow(2, d0, k).copy_(plain.narrow(2, s0, k))
                return
        plain.index_copy_(2, d, plain.index_select(2, s))

    def snapshot(self, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows of ``slots`` (tests: bitwise comparisons)."""
        idx = self._idx(slots)
        return self.keys.index_select(2, idx).clone(), self.values.index_select(2, idx).clone()


def _run_start(idx: torch.Tensor) -> int:
    """The first index if ``idx`` is one ascending run of consecutive indices, else -1."""
    n = idx.numel()
    first = int(idx[0])
    if int(idx[-1]) - first != n - 1 or (n > 2 and not bool((idx.diff() == 1).all())):
        return -1
    return first


def _extend(t: torch.Tensor, new_cap: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[2] = new_cap - t.shape[2]
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], dim=2)


def slot_tensor(slots: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``slots`` as a 1-d long tensor. Through a typed array: ``torch.as_tensor`` of a list
    converts element by element (measured: 8k slots in 0.83 ms, against 0.16 ms this way,
    paid by every decode step of a sequence over an 8k context)."""
    if isinstance(slots, torch.Tensor):
        return slots.to(device=device, dtype=torch.long)
    buf = array("q", slots)
    if not buf:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(buf, dtype=torch.long).to(device)
