"""``LeylineConnector``: held rows handed to a request as computed tokens (vLLM's KV
connector API, ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).

vLLM's prefix cache gives a request whole cached blocks only; the rows past a sequence's
last full block are held by the scheduler (``directives.held_rows``). The KV connector API
is vLLM's own way to say "these tokens were computed outside the prefix cache; load them
into the request's blocks":

- scheduler side: ``get_num_new_matched_tokens(request, num_local)`` asks the table for
  rows that extend the request's local hit (``LeylineScheduler.leyline_match``); vLLM
  then allocates the request's blocks and calls ``update_state_after_alloc``, which turns
  the match into a row copy ``held block offset i -> the request's block offset i``;
  ``build_connector_meta`` hands the step's copies to the workers. The source block gets a
  reference until the step that reads it has run (released at the next schedule).
- worker side: ``start_load_kv`` copies the rows on every attention layer before the
  forward pass (a synchronous load: vLLM starts it before the model runs and after it
  zeroes fresh blocks). Positions do not change, so the keys are copied as they are.

Nothing is saved or sent: the save hooks do nothing. Installed by the plugin's
``register`` as the default ``kv_transfer_config`` (see ``__init__``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from leyline_agent.directives.held_rows import RowsMatch
    from leyline_agent.vllm_plugin.worker import RowCopier

__all__ = ["CONNECTOR_NAME", "LeylineConnector", "RowLoads"]

CONNECTOR_NAME = "LeylineConnector"


class RowSource(Protocol):
    """What the connector needs of the scheduler (``scheduler.LeylineScheduler``)."""

    @property
    def block_pool(self) -> BlockPool: ...

    def leyline_match(self, request: Request, num_local: int) -> RowsMatch | None: ...


@dataclass
class RowLoads(KVConnectorMetadata):
    """One step's copies: rows at ``src`` slots into ``dst`` slots, every layer."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)


class LeylineConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.scheduler: RowSource | None = None  # the scheduler binds itself (its role)
        self._matched: dict[str, RowsMatch] = {}  # by request id
        self._loads = RowLoads()
        self._pinned: list[KVCacheBlock] = []  # source blocks read by the step being built
        self._copier: RowCopier | None = None

    @property
    def requires_kv_delivery(self) -> bool:
        """Nothing is handed off: a preempted request owes no one its blocks."""
        return False

    # -- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self._matched.pop(request.request_id, None)
        if self.scheduler is None:
            return 0, False
        match = self.scheduler.leyline_match(request, num_computed_tokens)
        if match is None:
            return 0, False
        self._matched[request.request_id] = match
        return match.num_rows, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        match = self._matched.pop(request.request_id, None)
        if match is None or num_external_tokens <= 0:
            return
        n = min(num_external_tokens, match.num_rows)
        b = self.block_size
        dst_block = blocks.get_block_ids()[0][match.held.base // b]
        src_block = match.held.block_id
        self._loads.src.extend(src_block * b + i for i in range(n))
        self._loads.dst.extend(dst_block * b + i for i in range(n))
        self.scheduler.block_pool.touch([match.held.block])
        self._pinned.append(match.held.block)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._loads = self._loads, RowLoads()
        return meta

    def leyline_step_done(self) -> None:
        """The step that read the pinned source blocks has run (async scheduling is off on
        this backend): give their references back."""
        if self._pinned and self.scheduler is not None:
            self.scheduler.block_pool.free_blocks(self._pinned)
        self._pinned = []

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        self._matched.pop(request.request_id, None)
        return False, None

    # -- worker side -----------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: object) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RowLoads) or not meta.src:
            return
        if self._copier is None:
            from leyline_agent.vllm_plugin.worker import RowCopier

            self._copier = RowCopier(self._vllm_config)
        self._copier.copy(meta.src, meta.dst, [0] * len(meta.src))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: object,
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
