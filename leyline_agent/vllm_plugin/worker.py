"""Worker side: ``--worker-extension-cls leyline_agent.vllm_plugin.worker.LeylineWorkerExtension``.

vLLM mixes this class into its worker (``WorkerWrapperBase.init_worker``); the EngineCore
reaches its methods with ``collective_rpc`` on every worker (every TP rank holds its own
heads of every block; the same slot plan applies to all of them):

- ``leyline_describe()``: what the splice needs to know and check: block size, dtype, ISA
  and KV layout (probed with the backend's own write op, ``kv_rows.probe_layout``), and
  whether the model's rotary band can be moved in closed form (``RopeSpec``).
- ``leyline_copy_rows(src, dst, delta)``: for every attention layer, copy the rows at
  ``src`` slots into ``dst`` slots, keys rotated by ``delta`` (``kernels.apply_plan``, the
  torch reference path on CPU). All rows are read before any is written; ``dst`` are fresh
  blocks nobody reads yet.
- ``leyline_repair_rows(token_ids, rows, slots)``: REPAIR's selected rows of a spliced ``T'``
  recomputed in place through the model's own layers (``row_forward``); ``leyline_describe``
  says in ``repair_problem`` why it cannot run on this model, if it cannot.
"""

from __future__ import annotations

from typing import Any

import torch

from leyline_agent.errors import RopeSpecError, RuntimeUnavailableError
from leyline_agent.kernels import RopeSpec, apply_plan, plan_rotation
from leyline_agent.vllm_plugin.kv_rows import Layout, probe_layout, read_rows, write_rows
from leyline_agent.vllm_plugin.row_forward import RowForward, repair_problem

__all__ = [
    "GQA_MODEL_TYPES",
    "LeylineWorkerExtension",
    "RowCopier",
    "attention_caches",
    "rope_spec",
]

# vLLM builds these with is_neox_style=True: the cached key's rotary band is half-split,
# as transformers' (RopeSpec cache_owner="transformers").
GQA_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class LeylineWorkerExtension:
    """Mixed into vLLM's worker; ``self`` is the worker (``self.model_runner``, ...)."""

    def _leyline_layers(self) -> list[tuple[torch.Tensor, str]]:
        return attention_caches(self.vllm_config)  # type: ignore[attr-defined]

    def _leyline_spec(self) -> RopeSpec:
        return rope_spec(self.vllm_config)  # type: ignore[attr-defined]

    def leyline_describe(self) -> dict[str, Any]:
        layers = self._leyline_layers()
        info: dict[str, Any] = {"num_layers": len(layers), "problem": None, "field": None}
        try:
            if not layers:
                raise RuntimeUnavailableError("kv_cache: no attention layer holds a KV cache")
            if self.vllm_config.model_config.use_mla:  # type: ignore[attr-defined]
                raise RuntimeUnavailableError("kv_cache_layout: MLA caches are not supported")
            kv, isa = layers[0]
            shapes = {tuple(t.shape) for t, _ in layers}
            if len(shapes) != 1:
                raise RuntimeUnavailableError(f"kv_cache_layout: layers differ in shape {shapes}")
            if kv.device.type != "cpu":
                raise RuntimeUnavailableError(
                    f"kv_cache_layout: cache on {kv.device}; only the CPU backend's layout is known"
                )
            info.update(block_size=int(kv.shape[2]), kv_heads=int(kv.shape[1]),
                        head_size=int(kv.shape[3]) // 2, dtype=str(kv.dtype), isa=isa)  # fmt: skip
            layout = probe_layout(kv, isa)
            info["keys_transposed"] = layout.keys_transposed
            spec = self._leyline_spec()
            if spec.rotary_dim != info["head_size"]:
                raise RopeSpecError(
                    f"rotary_dim: {spec.rotary_dim} != head_size {info['head_size']}"
                )
        except (RuntimeUnavailableError, RopeSpecError) as e:
            info["problem"] = str(e)
            info["field"] = str(e).split(":", 1)[0]
        info["repair_problem"] = repair_problem(self.model_runner.get_model())  # type: ignore[attr-defined]
        return info

    def leyline_repair_rows(self, token_ids: list[int], rows: list[int], slots: list[int]) -> int:
        if getattr(self, "_leyline_rows", None) is None:
            self._leyline_rows = RowForward(self.model_runner.get_model())  # type: ignore[attr-defined]
        return self._leyline_rows.run(token_ids, rows, slots)

    def leyline_copy_rows(self, src: list[int], dst: list[int], delta: list[int]) -> int:
        if getattr(self, "_leyline_copier", None) is None:
            self._leyline_copier = RowCopier(self.vllm_config)  # type: ignore[attr-defined]
        return self._leyline_copier.copy(src, dst, delta)


def rope_spec(vllm_config: Any) -> RopeSpec:
    """How the served model's cached keys rotate (GQA families vLLM builds neox-style)."""
    hf = vllm_config.model_config.hf_config
    if hf.model_type not in GQA_MODEL_TYPES:
        raise RopeSpecError(
            f"model_type: {hf.model_type!r}; the vLLM plugin splices {sorted(GQA_MODEL_TYPES)}"
        )
    return RopeSpec.from_hf_config(hf, cache_owner="transformers")


def attention_caches(vllm_config: Any) -> list[tuple[torch.Tensor, str]]:
    """Every attention layer's KV cache tensor (once each) with the backend's ISA name."""
    ctx = vllm_config.compilation_config.static_forward_context
    out, seen = [], set()
    for layer in ctx.values():
        kv = getattr(layer, "kv_cache", None)
        if not isinstance(kv, torch.Tensor) or kv.numel() == 0 or kv.dim() != 4:
            continue
        if kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        out.append((kv, str(getattr(layer, "isa", ""))))
    return out


class RowCopier:
    """Copies rows between slots of every attention layer, keys moved by a per-row delta
    (``kernels.apply_plan``, the torch path on CPU). All rows of a layer are read before
    any is written. Used by the worker extension (splices) and by the connector's worker
    side (held rows loaded into a request's block: delta 0)."""

    def __init__(self, vllm_config: Any) -> None:
        self._config = vllm_config
        self._layout: Layout | None = None

    def copy(self, src: list[int], dst: list[int], delta: list[int]) -> int:
        if not src:
            return 0
        if not len(src) == len(dst) == len(delta):
            raise ValueError("src, dst and delta must have the same length")
        layers = attention_caches(self._config)
        kv0, isa = layers[0]
        if self._layout is None:
            self._layout = probe_layout(kv0, isa)
        src_t = torch.tensor(src, dtype=torch.int64)
        dst_t = torch.tensor(dst, dtype=torch.int64)
        d_t = torch.tensor(delta, dtype=torch.int64)
        moved = (d_t != 0).nonzero().squeeze(1)
        spec = rope_spec(self._config) if moved.numel() else None
        plan = None
        for kv, layer_isa in layers:
            keys, values = read_rows(kv, src_t, Layout(layer_isa, self._layout.keys_transposed))
            if moved.numel():
                band = keys.index_select(0, moved).transpose(0, 1).contiguous()  # [H, K, D]
                if plan is None:
                    idx = torch.arange(moved.numel())
                    plan = plan_rotation(band, idx, idx, d_t[moved], spec, 0, "torch")
                apply_plan(band, plan, spec)
                keys.index_copy_(0, moved, band.transpose(0, 1))
            write_rows(kv, dst_t, keys, values, layer_isa)
        return len(src)
