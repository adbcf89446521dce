"""The plugin's row addressing on every vLLM 0.32 attention cache layout it accepts (no server).

Caches are allocated by vLLM's own code (``kv_cache_interface.compute_layout_strides`` and
``create_kv_cache_views``, as ``worker/utils.allocate_kv_cache`` does) for each backend's
spec and each ``KVCacheLayout`` the backend declares (``supported_kv_cache_layouts``; ``None``
lets the engine pick any). Rows are written through the backend's own write code:

- FlashAttention and Triton attention: the impl's ``do_kv_cache_update`` (the backend's view
  ``kv.transpose(1, 2).split(head_size)``), with its CUDA / Triton scatter op replaced by
  ``_scatter`` (that op's contract: ``key_cache[slot // N, slot % N] = key``): neither op
  runs on this CPU.
- FlashInfer does not import here (no ``flashinfer``): its view expression and its declared
  layouts on SM100 (``LBHNC``, ``BLHNC``) are reproduced from ``flashinfer.py``'s source.
- MLA (TRITON_MLA's spec and layouts; CPU_MLA's own write code, ``CPUMLAImpl``, and vLLM's
  CPU MLA op ``concat_and_cache_mla_cpu`` for bf16): the CUDA ``concat_and_cache_mla`` does
  not run here.
- CPU_ATTN: the real backend and op.

The plugin (``RowCopier``: probe, read, rotate, write) then moves rows by ``delta``; the
moved keys are checked against float64 RoPE from scratch (``kernels.reference.rope_float64``
with the frequencies of transformers' own rotary module), read back through the backend's
own view, values and latents bitwise. Each backend has cases that must be refused.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from transformers import DeepseekV2Config, LlamaConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from vllm.v1.attention.backends import flash_attn, triton_attn
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    _get_attn_isa,
)
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from leyline_agent.kernels.paged_rows import UnsupportedLayoutError
from leyline_agent.kernels.reference import rope_float64
from leyline_agent.reference.rope_configs import deepseek_v2_lite_yarn, gqa_dims, mla_dims
from leyline_agent.vllm_plugin.layer_rows import layer_layout, rope_band
from leyline_agent.vllm_plugin.worker import RowCopier

BLOCKS, LAYERS = 6, 2
ALL = tuple(KVCacheLayout)
TOL = 5e-5


def _scatter(key, value, key_cache, value_cache, slot_mapping, *_: Any, **__: Any) -> None:
    """reshape_and_cache_flash's contract (csrc/cache_kernels.cu): [B, N, H, D] caches."""
    n = key_cache.shape[1]
    key_cache[slot_mapping // n, slot_mapping % n] = key.to(key_cache.dtype)
    value_cache[slot_mapping // n, slot_mapping % n] = value.to(value_cache.dtype)


class FlashInferSM100:
    """FlashInferBackend's declarations (flashinfer.py; the module needs ``flashinfer``)."""

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @classmethod
    def is_mla(cls) -> bool:
        return False

    @classmethod
    def is_sparse(cls) -> bool:
        return False

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)  # capability.major == 10


def _flashinfer_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
    # FlashInferImpl.do_kv_cache_update, non-NVFP4 branch
    k_cache, v_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
    _scatter(key, value, k_cache, v_cache, slot_mapping)


def _allocate(spec: Any, layout: KVCacheLayout) -> list[torch.Tensor]:
    """Per-layer [B, H, N, C] views as vLLM's allocate_kv_cache makes them."""
    strides = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(LAYERS)],
                           layer_stride=strides[0], block_stride=strides[1])  # fmt: skip
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)


def _layer(kv, backend, impl, spec, **extra) -> Any:
    layer = types.SimpleNamespace(kv_cache=kv, attn_backend=backend, impl=impl,
                                  kv_cache_dtype="auto", _k_scale=torch.ones(()),
                                  _v_scale=torch.ones(()), get_kv_cache_spec=lambda cfg: spec)  # fmt: skip
    layer.__dict__.update(extra)
    return layer


def _config(layers: list[Any], layout: KVCacheLayout, hf: Any, cache_dtype: str = "auto"):
    ns = types.SimpleNamespace
    return ns(
        compilation_config=ns(static_forward_context={f"l{i}": x for i, x in enumerate(layers)}),
        cache_config=ns(kv_cache_layout=layout.name, cache_dtype=cache_dtype),
        model_config=ns(hf_config=hf),
    )


# -- GQA backends ---------------------------------------------------------------------------
HEADS, D, N = 2, 64, 16
LLAMA = LlamaConfig(**gqa_dims(), head_dim=D, num_hidden_layers=LAYERS)


def _gqa_impl(name: str, monkeypatch) -> Any:
    fake = types.SimpleNamespace(attn_type="decoder", head_size=D, kv_cache_dtype="auto",
                                 _is_per_token_head_quant=False)  # fmt: skip
    if name == "FLASH_ATTN":
        monkeypatch.setattr(flash_attn, "reshape_and_cache_flash", _scatter, raising=False)
        update = FlashAttentionImpl.do_kv_cache_update
    elif name == "TRITON_ATTN":
        monkeypatch.setattr(triton_attn, "triton_reshape_and_cache_flash", _scatter)
        update = TritonAttentionImpl.do_kv_cache_update
    else:
        update = _flashinfer_update
    fake.do_kv_cache_update = types.MethodType(update, fake)
    return fake


GQA = {"FLASH_ATTN": FlashAttentionBackend, "TRITON_ATTN": TritonAttentionBackend,
       "FLASHINFER": FlashInferSM100}  # fmt: skip


def _gqa_cases():
    for name, backend in GQA.items():
        for layout in backend.supported_kv_cache_layouts() or ALL:
            yield pytest.param(name, layout, id=f"{name}-{layout.name}")


def _gqa_setup(name, layout, monkeypatch, dtype=torch.float32, alloc_layout=None):
    spec = FullAttentionSpec(block_size=N, num_kv_heads=HEADS, head_size=D, dtype=dtype)
    views = _allocate(spec, alloc_layout or layout)
    impl = _gqa_impl(name, monkeypatch)
    layers = [_layer(kv, GQA[name], impl, spec) for kv in views]
    return views, _config(layers, layout, LLAMA), impl


def _rope_keys(n: int, pos: torch.Tensor, inv_freq, layout: str, width: int, seed: int = 1,
               offset: int = 0):  # fmt: skip
    """Base keys ``[n, H, width]`` and their float64 RoPE at ``pos`` (one position a row)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(n, HEADS, width, generator=g, dtype=torch.float64) * 2 - 1
    out = torch.stack([torch.stack([rope_float64(base[i, h], pos[i : i + 1], inv_freq, layout,
                                                  offset)[0] for h in range(HEADS)])
                       for i in range(n)])  # fmt: skip
    return base, out


@pytest.mark.parametrize(("name", "layout"), list(_gqa_cases()))
def test_gqa_rows_move_as_float64_rope(name, layout, monkeypatch):
    views, cfg, impl = _gqa_setup(name, layout, monkeypatch)
    inv = LlamaRotaryEmbedding(LLAMA).inv_freq
    src = torch.tensor([3, 17, 18, 40])  # rows of blocks 0, 1, 2
    dst = torch.tensor([64, 65, 79, 80])  # blocks 4 and 5
    pos = torch.tensor([3, 900, 901, 4100])
    delta = [-2, 0, 129, -4000]
    for i, kv in enumerate(views):
        _, keys = _rope_keys(4, pos, inv, "half", D, seed=i)
        values = torch.randn(4, HEADS, D, generator=torch.Generator().manual_seed(i))
        layer = cfg.compilation_config.static_forward_context[f"l{i}"]
        impl.do_kv_cache_update(layer, keys.float(), values, kv, src)
    before = [kv.clone() for kv in views]
    assert RowCopier(cfg).copy(src.tolist(), dst.tolist(), delta) == 4
    for i, kv in enumerate(views):
        k_cache, v_cache = kv.transpose(1, 2).split(D, dim=-1)  # the backend's own view
        _, b_cache = before[i].transpose(1, 2).split(D, dim=-1)
        base, _ = _rope_keys(4, pos, inv, "half", D, seed=i)
        for r in range(4):
            want = torch.stack([rope_float64(base[r, h], pos[r : r + 1] + delta[r], inv, "half")[0]
                                for h in range(HEADS)])  # fmt: skip
            got = k_cache[dst[r] // N, dst[r] % N].double()
            torch.testing.assert_close(got, want, atol=TOL, rtol=0)
            assert torch.equal(v_cache[dst[r] // N, dst[r] % N], b_cache[src[r] // N, src[r] % N])
        untouched = torch.ones(BLOCKS * N, dtype=torch.bool)
        untouched[dst] = False
        for s in untouched.nonzero().squeeze(1).tolist():  # nothing else changed
            assert torch.equal(kv[s // N, :, s % N], before[i][s // N, :, s % N])


@pytest.mark.parametrize("name", list(GQA))
def test_a_wrong_stride_order_is_refused(name, monkeypatch):
    """The engine resolved one layout, the tensor lies in memory in another."""
    declared = (GQA[name].supported_kv_cache_layouts() or ALL)[0]
    other = next(x for x in ALL if x.layer_view_order != declared.layer_view_order)
    views, cfg, _ = _gqa_setup(name, declared, monkeypatch, alloc_layout=other)
    kv, layer = views[0], cfg.compilation_config.static_forward_context["l0"]
    with pytest.raises(UnsupportedLayoutError, match=f"backend {name}: the cache's stride order"):
        layer_layout(layer, kv, cfg)


def test_flashinfer_refuses_a_layout_it_does_not_declare(monkeypatch):
    views, cfg, _ = _gqa_setup("FLASHINFER", KVCacheLayout.LBNHC, monkeypatch)
    layer = cfg.compilation_config.static_forward_context["l0"]
    with pytest.raises(
        UnsupportedLayoutError,
        match=r"backend FLASHINFER: the resolved layout LBNHC is not one it declares",
    ):
        layer_layout(layer, views[0], cfg)


@pytest.mark.parametrize("name", list(GQA))
def test_quantized_rows_and_a_disagreeing_op_are_refused(name, monkeypatch):
    layout = (GQA[name].supported_kv_cache_layouts() or ALL)[0]
    views, cfg, impl = _gqa_setup(name, layout, monkeypatch)
    layer = cfg.compilation_config.static_forward_context["l0"]
    cfg.cache_config.cache_dtype = "fp8_e4m3"
    with pytest.raises(UnsupportedLayoutError, match=f"backend {name}: kv_cache_dtype fp8_e4m3"):
        layer_layout(layer, views[0], cfg)
    cfg.cache_config.cache_dtype = "auto"

    def swapped(layer, key, value, kv, slots):  # an op that stores values first
        impl_view = kv.transpose(1, 2).split(D, dim=-1)
        _scatter(value, key, impl_view[0], impl_view[1], slots)

    layer.impl = types.SimpleNamespace(do_kv_cache_update=swapped)
    with pytest.raises(UnsupportedLayoutError, match=f"backend {name}: its write op stores rows"):
        layer_layout(layer, views[0], cfg)


# -- MLA ------------------------------------------------------------------------------------
RANK, ROPE = 64, 64
DSV2 = DeepseekV2Config(**mla_dims(), num_hidden_layers=LAYERS)
MLA_DTYPES = {"CPU_MLA torch": torch.float32, "concat_and_cache_mla_cpu": torch.bfloat16}


def _mla_impl(kind: str) -> Any:
    if kind == "CPU_MLA torch":
        update = types.MethodType(CPUMLAImpl.do_kv_cache_update, types.SimpleNamespace())
    else:
        from vllm import _custom_ops as ops

        def update(kv_c, k_pe, kv, slots, kv_cache_dtype, k_scale):
            ops.amx_mla_concat_and_cache(kv_c, k_pe.squeeze(1), kv[:, 0], slots)

    return types.SimpleNamespace(do_kv_cache_update=update)


def _mla_setup(backend, kind, layout, alloc_layout=None):
    spec = MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=RANK + ROPE,
                            dtype=MLA_DTYPES[kind])  # fmt: skip
    views = _allocate(spec, alloc_layout or layout)
    impl = _mla_impl(kind)
    layers = [_layer(kv, backend, impl, spec, kv_lora_rank=RANK) for kv in views]
    return views, _config(layers, layout, DSV2), impl


# the CPU write code views each layer's cache whole: layer-outermost layouts only
MLA_LAYOUTS = [x for x in ALL if x.is_layer_compact]


@pytest.mark.parametrize("backend", [TritonMLABackend, CPUMLABackend], ids=lambda b: b.get_name())
@pytest.mark.parametrize("kind", list(MLA_DTYPES))
@pytest.mark.parametrize("layout", MLA_LAYOUTS, ids=lambda x: x.name)
def test_mla_latent_rows_move_as_float64_rope(backend, kind, layout):
    if backend.supported_kv_cache_layouts() is not None:
        assert layout in backend.supported_kv_cache_layouts()
    views, cfg, impl = _mla_setup(backend, kind, layout)
    inv = DeepseekV2RotaryEmbedding(DSV2).inv_freq
    dtype = MLA_DTYPES[kind]
    src, dst = torch.tensor([5, 20, 21]), torch.tensor([48, 49, 95])
    pos, delta = torch.tensor([5, 700, 701]), [40, 0, -650]
    g = torch.Generator().manual_seed(2)
    base = torch.rand(3, RANK + ROPE, generator=g, dtype=torch.float64) * 2 - 1
    rows = torch.stack([rope_float64(base[r], pos[r : r + 1], inv, "interleaved", RANK)[0]
                        for r in range(3)])  # fmt: skip
    for kv in views:
        impl.do_kv_cache_update(rows[:, :RANK].to(dtype), rows[:, None, RANK:].to(dtype), kv, src,
                                "auto", None)  # fmt: skip
    assert RowCopier(cfg).copy(src.tolist(), dst.tolist(), delta) == 3
    stored = rows.to(dtype).double()  # what the cache held before the move
    for kv in views:
        for r in range(3):
            got = kv[dst[r] // N, 0, dst[r] % N].double()
            assert torch.equal(got[:RANK], stored[r, :RANK])  # the latent is not rotated
            want = rope_float64(stored[r], torch.tensor([delta[r]]), inv, "interleaved", RANK)[0]
            tol = TOL if dtype == torch.float32 else 2e-2  # bf16 storage of the turned band
            torch.testing.assert_close(got[RANK:], want[RANK:], atol=tol, rtol=0)


def test_mla_wrong_stride_order_and_sparse_are_refused():
    """With one head slot every vLLM layout orders an MLA layer B, N, C: a cache whose rows
    run across blocks (N outside B) is not one of them."""
    views, cfg, _ = _mla_setup(TritonMLABackend, "CPU_MLA torch", KVCacheLayout.LBNHC)
    layer = cfg.compilation_config.static_forward_context["l0"]
    wrong = torch.zeros(N, BLOCKS, 1, RANK + ROPE).permute(1, 2, 0, 3)
    with pytest.raises(
        UnsupportedLayoutError, match="backend TRITON_MLA: the cache's stride order"
    ):
        layer_layout(layer, wrong, cfg)

    class Sparse(TritonMLABackend):
        @classmethod
        def is_sparse(cls) -> bool:
            return True

    layer.attn_backend = Sparse
    with pytest.raises(UnsupportedLayoutError, match="backend TRITON_MLA: sparse MLA"):
        layer_layout(layer, views[1], cfg)


# -- CPU_ATTN -------------------------------------------------------------------------------
def _cpu_setup(alloc_layout: KVCacheLayout, n: int = 32):
    """CPU_ATTN layers (the real backend, its impl's write code and op); ``n`` rows a block:
    the CPU kernels take multiples of 32."""
    spec = FullAttentionSpec(block_size=n, num_kv_heads=HEADS, head_size=D, dtype=torch.float32)
    views = _allocate(spec, alloc_layout)
    fake = types.SimpleNamespace(attn_type="decoder", kv_cache_dtype="auto")
    impl = types.SimpleNamespace(
        do_kv_cache_update=types.MethodType(CPUAttentionBackendImpl.do_kv_cache_update, fake)
    )
    isa = _get_attn_isa(torch.float32, n, D)
    layers = [_layer(kv, CPUAttentionBackend, impl, spec, isa=isa, _k_scale_float=1.0,
                     _v_scale_float=1.0) for kv in views]  # fmt: skip
    return spec, views, impl, layers


@pytest.mark.parametrize(("name", "layout"), list(_gqa_cases()))
def test_a_whole_block_at_delta_0_moves_every_element_and_rows_beside_it_move_as_rows(
    name, layout, monkeypatch
):
    """A splice's prefix (a whole block, in order, delta 0) is copied block by block; the
    rows around it (a block not in order, a row turned) go the row way; nothing else moves."""
    views, cfg, _ = _gqa_setup(name, layout, monkeypatch)
    g = torch.Generator().manual_seed(5)
    for kv in views:
        kv.copy_(torch.randn(kv.shape, generator=g))
    whole = list(range(N, 2 * N))  # block 1 -> block 4, in order
    src = [*whole, 2 * N + 1, 2 * N]  # two rows of block 2, swapped, into block 5
    dst = [*range(4 * N, 5 * N), 5 * N, 5 * N + 1]
    before = [kv.clone() for kv in views]
    assert RowCopier(cfg).copy(src, dst, [0] * len(src)) == N + 2
    for kv, old in zip(views, before, strict=True):
        assert torch.equal(kv[4], old[1])  # every element, whatever the layout in a block
        # the two rows: block 5 now reads as block 2 with its rows 0 and 1 swapped
        k_new, v_new = kv.transpose(1, 2).split(D, dim=-1)
        k_old, v_old = old.transpose(1, 2).split(D, dim=-1)
        for s, d in ((2 * N + 1, 5 * N), (2 * N, 5 * N + 1)):
            assert torch.equal(k_new[d // N, d % N], k_old[s // N, s % N])
            assert torch.equal(v_new[d // N, d % N], v_old[s // N, s % N])
        for b in (0, 1, 2, 3):
            assert torch.equal(kv[b], old[b])


def test_cpu_backend_refuses_what_it_does_not_declare():
    declared = CPUAttentionBackend.supported_kv_cache_layouts()[0]
    _, views, _, layers = _cpu_setup(KVCacheLayout.LBNHC)
    with pytest.raises(UnsupportedLayoutError, match="backend CPU_ATTN: the cache's stride order"):
        layer_layout(layers[0], views[0], _config(layers, declared, LLAMA))
    with pytest.raises(UnsupportedLayoutError, match="backend CPU_ATTN: the resolved layout LBNHC"):
        layer_layout(layers[0], views[0], _config(layers, KVCacheLayout.LBNHC, LLAMA))


def test_cpu_backend_rows_move_with_its_own_op():
    n = 32
    layout = CPUAttentionBackend.supported_kv_cache_layouts()[0]
    spec, views, impl, layers = _cpu_setup(layout, n)
    cfg = _config(layers, layout, LLAMA)
    rows = layer_layout(layers[0], views[0], cfg)
    inv = LlamaRotaryEmbedding(LLAMA).inv_freq
    src, dst, pos, delta = (
        torch.tensor([1, 40]),
        torch.tensor([64, 65]),
        torch.tensor([1, 500]),
        [7, -300],
    )
    base, keys = _rope_keys(2, pos, inv, "half", D)
    values = torch.randn(2, HEADS, D)
    for kv, layer in zip(views, layers, strict=True):
        impl.do_kv_cache_update(layer, keys.float(), values, kv, src)
    RowCopier(cfg).copy(src.tolist(), dst.tolist(), delta)
    # read back by writing the expected rows with the op into a fresh cache and comparing bytes
    want = torch.stack([torch.stack([rope_float64(base[r, h], pos[r : r + 1] + delta[r], inv,
                                                   "half")[0] for h in range(HEADS)])
                        for r in range(2)])  # fmt: skip
    fresh = _allocate(spec, layout)[0]
    impl.do_kv_cache_update(layers[0], want.float(), values, fresh, dst)
    blocks = dst // n
    torch.testing.assert_close(views[0][blocks], fresh[blocks], atol=TOL, rtol=0)
    assert rows.kind in ("chunk", "paged")


def test_mla_band_turns_as_vllms_deepseek_rotary():
    """The band's frequencies and pair layout are those of the rotary embedding vLLM's
    DeepSeek attention builds (``get_rope(..., is_neox_style=False)``, YaRN as
    ``deepseek_yarn``), bitwise."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    hf = deepseek_v2_lite_yarn()
    spec, band = rope_band(types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=hf)))
    params = dict(hf.rope_parameters) | {"rope_type": "deepseek_yarn"}
    with set_current_vllm_config(VllmConfig()):
        emb = get_rope(hf.qk_rope_head_dim, max_position=hf.max_position_embeddings,
                       rope_parameters=params, is_neox_style=False)  # fmt: skip
    assert band == hf.kv_lora_rank and spec.layout == "interleaved" and not emb.is_neox_style
    assert torch.equal(spec.inv_freq_tensor(), emb._compute_inv_freq(params["factor"]))


def test_the_gpu_checks_layout_table_is_vllms():
    """The prepared GPU check lays caches out without vLLM (it cannot travel there)."""
    from leyline_agent.experiments.bench.vllm_rows import LAYOUTS

    assert LAYOUTS == {x.name: x.value for x in KVCacheLayout}
