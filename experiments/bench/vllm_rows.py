"""The vLLM plugin's row moves on caches shaped as vLLM 0.32 declares them, on any device.

For the prepared GPU check (``leyline check gpu``, section ``vllm-rows``): vLLM itself cannot
travel to the GPU machine (its wheel is far over what can be carried there), so each cache is
built here as ``create_kv_cache_views`` builds it: a 5-D ``[L, B, H, N, C]`` allocation whose
axes lie in memory in the order of one ``KVCacheLayout`` (``LAYOUTS``, reproduced from
``vllm/v1/kv_cache_layout.py``; ``tests/vllm/test_vllm_cache_layouts.py`` checks the table
against vLLM's enum), one layer's ``[B, H, N, C]`` view taken. Rows are written as the
backends' ops store them (``reshape_and_cache_flash``: ``kv.transpose(1, 2).split(D)``
indexed ``[slot // N, slot % N]``; ``concat_and_cache_mla``: the latent row at
``[slot // N, 0, slot % N]``), moved by the plugin (``paged_rows.move_rows``: read, the band
turned by ``delta`` with the project's kernel, written to fresh slots) and compared with
float64 RoPE from scratch (``kernels.reference.rope_float64``) at the new positions; the
other rows of the cache must keep their bytes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LAYOUTS", "check", "layer_view"]

# KVCacheLayout member -> stride order of the logical [L, B, H, N, C] axes
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
# (label, head slots, key width, value width, band offset, rotary pairs, pair layout)
KINDS = [("gqa 8x128 k|v", 8, 128, 128, 0, 64, "half"),
         ("mla 576 band 64@512", 1, 576, 0, 512, 32, "interleaved")]  # fmt: skip


def layer_view(layout: str, shape: tuple[int, ...], dtype: Any, device: str, layer: int = 1):
    """Layer ``layer`` of a zeroed ``[L, B, H, N, C]`` cache laid out as ``layout``."""
    import torch

    order = LAYOUTS[layout]
    physical = torch.zeros([shape[i] for i in order], dtype=dtype, device=device)
    return physical.permute([order.index(i) for i in range(5)])[layer]


def _store(kv: Any, slots: Any, rows: Any, key_width: int, mla: bool) -> None:
    n = kv.shape[2]
    if mla:  # concat_and_cache_mla
        kv[slots // n, 0, slots % n] = rows[:, 0].to(kv.dtype)
        return
    k_cache, v_cache = kv.transpose(1, 2).split(key_width, dim=-1)  # reshape_and_cache_flash
    k_cache[slots // n, slots % n] = rows[..., :key_width].to(kv.dtype)
    v_cache[slots // n, slots % n] = rows[..., key_width:].to(kv.dtype)


def _rope(keys: Any, pos: Any, inv_freq: Any, pairs: str, off: int) -> Any:
    """float64 RoPE of ``keys`` ``[R, H, W]``, row ``r`` at ``pos[r]``."""
    import torch

    from leyline_agent.kernels.reference import rope_float64

    return torch.stack([torch.stack([rope_float64(keys[r, h], pos[r : r + 1], inv_freq, pairs,
                                                  off)[0] for h in range(keys.shape[1])])
                        for r in range(keys.shape[0])])  # fmt: skip


def check(device: str, blocks: int = 8, block_size: int = 16) -> None:
    """Print one row per layout, kind and dtype; raise at the first wrong result."""
    import torch

    from leyline_agent.kernels import RopeSpec
    from leyline_agent.kernels.paged_rows import RowLayout, move_rows

    print("vLLM-shaped caches: rows moved by paged_rows.move_rows against float64 RoPE")
    print(
        "| layout | kind | dtype | rows | max abs err | values / latent exact | others unchanged |"
    )
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    n_rows = blocks * block_size // 2
    src = torch.randperm(n_rows, generator=g)  # first half of the cache, shuffled
    dst = torch.arange(n_rows, 2 * n_rows)  # second half: fresh blocks
    pos = torch.randint(0, 8192, (n_rows,), generator=g)
    delta = torch.randint(-4000, 4000, (n_rows,), generator=g)
    delta[::5] = 0
    delta = torch.maximum(delta, -pos)
    for label, heads, kw, vw, off, half, pairs in KINDS:
        inv = 10000.0 ** -(torch.arange(half, dtype=torch.float64) / half)
        spec = RopeSpec(inv_freq=tuple(inv.float().tolist()), rotary_dim=2 * half, layout=pairs)
        inv32 = torch.tensor(spec.inv_freq, dtype=torch.float64)
        base = torch.rand(n_rows, heads, kw + vw, generator=g, dtype=torch.float64) * 2 - 1
        rows = _rope(base[..., :kw], pos, inv32, pairs, off)
        for dtype in (torch.float32, torch.bfloat16):
            stored = torch.cat([rows, base[..., kw:]], dim=-1).to(dtype)
            after = _rope(stored[..., :kw].double(), delta, inv32, pairs, off)
            for name in LAYOUTS:
                kv = layer_view(name, (2, blocks, heads, block_size, kw + vw), dtype, device)
                _store(kv, src.to(device), stored.to(device), kw, vw == 0)
                before = kv.clone()
                layout = RowLayout("paged", kw, vw)
                d = delta.to(device)
                move_rows(kv, layout, src.to(device), dst.to(device), d, spec, off)
                got = kv.transpose(1, 2)[dst // block_size, dst % block_size].double().cpu()
                band = slice(off, off + 2 * half)
                err = float((got[..., band] - after[..., band]).abs().max())
                rest = torch.ones(kw + vw, dtype=torch.bool)
                rest[band] = False  # values, and the latent outside the band
                exact = bool(torch.equal(got[..., rest], stored[..., rest].double()))
                untouched = bool(torch.equal(kv[: blocks // 2], before[: blocks // 2]))
                print(f"| {name} | {label} | {str(dtype)[6:]} | {n_rows} | {err:.2e} | {exact} "
                      f"| {untouched} |", flush=True)  # fmt: skip
                tol = 5e-5 if dtype == torch.float32 else 2e-2
                if err > tol or not exact or not untouched:
                    raise AssertionError(f"{name} {label} {dtype}: rows moved wrongly")
