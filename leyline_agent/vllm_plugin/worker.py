"""Worker side: ``--worker-extension-cls leyline_agent.vllm_plugin.worker.LeylineWorkerExtension``.

vLLM mixes this class into its worker (``WorkerWrapperBase.init_worker``); the EngineCore
reaches its methods with ``collective_rpc`` on every worker (every TP rank holds its own
heads of every block; the same slot plan applies to all of them):

- ``leyline_describe()``: what the splice needs to know and check: block size, dtype, the
  attention backend and its rows' layout (planned from vLLM's declarations and probed with
  the backend's own write op, ``layer_rows.layer_layout``), and whether the model's rotary
  band can be moved in closed form (``RopeSpec``).
- ``leyline_copy_rows(src, dst, delta)``: for every attention layer, copy the rows at
  ``src`` slots into ``dst`` slots, keys rotated by ``delta`` (``kernels.apply_plan``, the
  torch reference path on CPU). All rows are read before any is written; ``dst`` are fresh
  blocks nobody reads yet.
- ``leyline_repair_rows(token_ids, rows, slots)``: REPAIR's selected rows of a spliced ``T'``
  recomputed in place through the model's own layers (``row_forward``); ``leyline_describe``
  says in ``repair_problem`` why it cannot run on this model, if it cannot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from leyline_agent.errors import RopeSpecError, RuntimeUnavailableError
from leyline_agent.kernels import RopeSpec
from leyline_agent.vllm_plugin.kv_rows import RowLayout, move_rows
from leyline_agent.vllm_plugin.layer_rows import attention_layers, layer_layout, rope_band
from leyline_agent.vllm_plugin.row_forward import RowForward, repair_problem

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["LeylineWorkerExtension", "RowCopier"]


class LeylineWorkerExtension:
    """Mixed into vLLM's worker; ``self`` is the worker (``self.model_runner``, ...)."""

    def leyline_describe(self) -> dict[str, object]:
        cfg = self.vllm_config  # type: ignore[attr-defined]
        layers = attention_layers(cfg)
        info: dict[str, object] = {"num_layers": len(layers), "problem": None, "field": None}
        try:
            if not layers:
                raise RuntimeUnavailableError("kv_cache: no attention layer holds a KV cache")
            kv, layer = layers[0]
            shapes = {(tuple(t.shape), t.stride()) for t, _ in layers}
            if len(shapes) != 1:
                raise RuntimeUnavailableError(f"kv_cache_layout: layers differ in shape {shapes}")
            info.update(block_size=int(kv.shape[2]), kv_heads=int(kv.shape[1]),
                        dtype=str(kv.dtype), backend=layer.attn_backend.get_name(),
                        kv_cache_layout=cfg.cache_config.kv_cache_layout)  # fmt: skip
            rows = layer_layout(layer, kv, cfg)
            info.update(row_layout=rows.kind, head_size=rows.key_width,
                        keys_transposed=rows.keys_transposed)  # fmt: skip
            spec, band = rope_band(cfg)
            if (band == 0 and spec.rotary_dim != rows.key_width) or (
                band + spec.rotary_dim > rows.key_width
            ):
                raise RopeSpecError(
                    f"rotary_dim: {spec.rotary_dim} from {band} does not fit key rows of "
                    f"{rows.key_width}"
                )
        except (RuntimeUnavailableError, RopeSpecError) as e:
            info["problem"] = str(e)
            info["field"] = str(e).split(":", 1)[0]
        info["repair_problem"] = repair_problem(self.model_runner.get_model())  # type: ignore[attr-defined]
        return info

    def leyline_repair_rows(self, token_ids: list[int], rows: list[int], slots: list[int]) -> int:
        if getattr(self, "_leyline_rows", None) is None:
            self._leyline_rows = RowForward(self.model_runner.get_model(), self.vllm_config)  # type: ignore[attr-defined]
        return self._leyline_rows.run(token_ids, rows, slots)

    def leyline_copy_rows(self, src: list[int], dst: list[int], delta: list[int]) -> int:
        if getattr(self, "_leyline_copier", None) is None:
            self._leyline_copier = RowCopier(self.vllm_config)  # type: ignore[attr-defined]
        return self._leyline_copier.copy(src, dst, delta)


class RowCopier:
    """Copies rows between slots of every attention layer, keys moved by a per-row delta
    (``kernels.apply_plan``: the torch path on CPU, the project's kernel on CUDA). All rows
    of a layer are read before any is written. Used by the worker extension (splices) and
    by the connector's worker side (held rows loaded into a request's block: delta 0)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._config = vllm_config
        self._layout: RowLayout | None = None
        self._band: tuple[RopeSpec, int] | None = None  # the model's rotary band, read once

    def copy(self, src: list[int], dst: list[int], delta: list[int]) -> int:
        if not src:
            return 0
        if not len(src) == len(dst) == len(delta):
            raise ValueError("src, dst and delta must have the same length")
        layers = attention_layers(self._config)
        kv0, layer0 = layers[0]
        if self._layout is None:  # every layer's view has the first one's shape and strides
            self._layout = layer_layout(layer0, kv0, self._config)
        dev = kv0.device
        src_t = torch.tensor(src, dtype=torch.int64, device=dev)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=dev)
        d_t = torch.tensor(delta, dtype=torch.int64, device=dev)
        spec, band_offset = None, 0
        if any(delta):
            if self._band is None:
                self._band = rope_band(self._config)
            spec, band_offset = self._band
        plan = None
        for kv, _ in layers:
            plan = move_rows(kv, self._layout, src_t, dst_t, d_t, spec, band_offset, plan)
        return len(src)
