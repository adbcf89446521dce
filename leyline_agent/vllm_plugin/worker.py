"""Worker side: ``--worker-extension-cls leyline_agent.vllm_plugin.worker.LeylineWorkerExtension``.

vLLM mixes this class into its worker (``WorkerWrapperBase.init_worker``); the EngineCore
reaches its methods with ``collective_rpc`` on every worker (every TP rank holds its own
heads of every block; the same slot plan applies to all of them):

- ``leyline_describe()``: block size, dtype, the attention backend and its rows' layout
  (``layer_rows.layer_layout``), whether the model's rotary band can be moved in closed
  form (``RopeSpec``), and why REPAIR cannot run on this model, if it cannot.
- ``leyline_splice_rows(src, dst, delta, token_ids, rows, blocks)``: a splice's rows, in
  one call: the row copies (``RowCopier``; ``dst`` are fresh blocks nobody reads yet), then
  the rows it computes (``R``'s where the splice had no head request, and REPAIR's selected
  tail rows) forwarded in place over the spliced ``T'`` (``row_forward``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from leyline_agent.directives.block_plan import copy_runs
from leyline_agent.errors import RopeSpecError, RuntimeUnavailableError
from leyline_agent.kernels import RopeSpec, RotationPlan
from leyline_agent.kernels.paged_rows import RowLayout, move_rows
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

    def leyline_splice_rows(
        self,
        src: list[int],
        dst: list[int],
        delta: list[int],
        token_ids: list[int],
        rows: list[int],
        blocks: list[int],
    ) -> int:
        """Copy ``src`` to ``dst`` (keys turned by ``delta``), then compute ``rows`` of
        ``T'`` (their tokens ``token_ids``; ``blocks``: ``T'``'s blocks through the last
        row's); the number of rows written."""
        copied = self._leyline_copier().copy(src, dst, delta)
        if not rows:
            return copied
        if getattr(self, "_leyline_rows", None) is None:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            self._leyline_rows = RowForward(model, self._leyline_copier().layout)
        return copied + self._leyline_rows.run(token_ids, rows, blocks)

    def _leyline_copier(self) -> RowCopier:
        if getattr(self, "_leyline_rows_copier", None) is None:
            self._leyline_rows_copier = RowCopier(self.vllm_config)  # type: ignore[attr-defined]
        return self._leyline_rows_copier


class RowCopier:
    """Copies rows between slots of every attention layer: runs of whole blocks at delta 0
    as slice copies, every other run of rows that shares a delta with
    ``paged_rows.move_rows`` (keys turned by the delta; a splice's tail is one such run,
    read as whole blocks). Used by the worker extension (splices) and the connector's
    worker side (held rows: delta 0)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._config = vllm_config
        self._layout: RowLayout | None = None
        self._band: tuple[RopeSpec, int] | None = None  # the model's rotary band, read once

    @property
    def layout(self) -> RowLayout:
        """The row layout of every layer's cache (probed once: they share the first one's
        shape and strides, ``leyline_describe`` checks)."""
        if self._layout is None:
            kv, layer = attention_layers(self._config)[0]
            self._layout = layer_layout(layer, kv, self._config)
        return self._layout

    def copy(self, src: list[int], dst: list[int], delta: list[int]) -> int:
        if not src:
            return 0
        if not len(src) == len(dst) == len(delta):
            raise ValueError("src, dst and delta must have the same length")
        layout, layers = self.layout, attention_layers(self._config)
        kv0 = layers[0][0]
        block_runs, row_runs = copy_runs(src, dst, delta, int(kv0.shape[2]))
        src_t, dst_t, d_t = (
            torch.tensor(x, dtype=torch.int64, device=kv0.device) for x in (src, dst, delta)
        )
        spec, band_offset = None, 0
        if any(delta):
            if self._band is None:
                self._band = rope_band(self._config)
            spec, band_offset = self._band
        plans: list[RotationPlan | None] = [None] * len(row_runs)  # one per run, every layer
        for kv, _ in layers:
            # sources are never destinations (``dst`` are fresh): read-before-write holds
            for sb, db, count in block_runs:
                kv[db : db + count].copy_(kv[sb : sb + count])
            for r, (i, j) in enumerate(row_runs):
                plans[r] = move_rows(
                    kv, layout, src_t[i:j], dst_t[i:j], d_t[i:j], spec, band_offset, plans[r]
                )
        return len(src)
