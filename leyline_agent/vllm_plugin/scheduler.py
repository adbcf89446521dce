"""Scheduler side: ``LeylineScheduler``, vLLM 0.32's ``Scheduler`` with five additions.

1. **Routing** (``add_request``): every request without a salt of its own is served under
   its Leyline namespace's salt or under none (``namespace.route_salt``); its block hashes
   are recomputed when the salt changes. This is what keeps spliced blocks to their
   session. A namespace that holds a prompt's first rows in a held block is routed as if
   it held the first block.
2. **Holding a head** (``_free_request``): a request whose ``sampling_params.extra_args``
   names ``leyline_hold`` is a directive's head (``T[:s] + R`` prefilled by vLLM's own
   request path). When it finishes its blocks (the last, partial one too, which vLLM would
   not cache) are kept with one reference until the splice reads them.
3. **Held rows** (``directives.held_rows``): a finished request's rows past its last full
   block, a splice's ``T'`` rows past its last full block and a directive's prefix rows
   inside a block (``engine_ops``) are kept per namespace; ``LeylineConnector`` hands them
   to the namespace's next request whose prompt starts with their tokens (``leyline_match``).
4. **Pins** (``directives.pin_table`` on the block pool, ``pins``): a splice result's full
   blocks are held with one extra reference each; pinned blocks stay within half the pool,
   and when an allocation finds the pool short (``KVCacheManager.allocate_slots`` answers
   ``None``) the oldest pin gives way before vLLM preempts or queues anything.
5. **Counters** of the requests it served, for ``/leyline/v1/stats``.

The splice itself (``engine_ops``) runs inside the EngineCore between two steps, as a
utility call: it reads this scheduler's ``BlockPool`` and asks the workers to copy rows.
Only ``BlockPool``'s own methods touch blocks: ``touch`` (a reference), ``get_new_blocks``,
``cache_full_blocks`` (register under a hash chain), ``evict_blocks`` (drop a hash),
``free_blocks``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import takewhile
from typing import TYPE_CHECKING, Any

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from leyline_agent.directives.held_rows import HeldRows, HeldRowsTable, RowsMatch
from leyline_agent.directives.pin_table import PinTable, Refs
from leyline_agent.directives.sequences import SequenceIndex
from leyline_agent.namespaces import ANONYMOUS
from leyline_agent.vllm_plugin.namespace import is_leyline_salt, route_salt, salt_for
from leyline_agent.vllm_plugin.pins import TTL_ENV, BlockRows, Watch, ttl_from_env
from leyline_agent.wire import Counters

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput

    BlockHasher = Callable[[Request], list[BlockHash]]  # vLLM's request_block_hasher

__all__ = ["HOLD_KEY", "Held", "LeylineScheduler", "block_request"]

HOLD_KEY = "leyline_hold"
log = logging.getLogger(__name__)
ANONYMOUS_SALT = salt_for(ANONYMOUS)
HOLD_TTL_S = 120.0
LOSS_SWEEP_S = 1.0  # how often unheld pins are checked for lost rows (pin_evictions)


def block_request(
    tokens: list[int], salt: str | None, hasher: BlockHasher, request_id: str = "leyline-probe"
) -> Request:
    """A request of ``tokens`` under ``salt`` that is never scheduled: its ``block_hashes``
    are the hash chain vLLM gives those tokens (its own hasher), and the block pool takes it
    as the owner of blocks it registers."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=salt,
        block_hasher=hasher,
    )


@dataclass(slots=True)
class Held:
    """Blocks kept with one reference each (a head's, or a directive's base ``T``)."""

    blocks: list[KVCacheBlock]
    salt: str | None
    num_cached_tokens: int = 0
    since: float = field(default_factory=time.monotonic)


class LeylineScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.leyline_held: dict[str, Held] = {}
        self.leyline_served = Counters()  # plain generations (directives: the route counts)
        self._leyline_cached: dict[str, int] = {}
        self._leyline_heads: dict[str, str] = {}  # request id -> hold id
        self._leyline_ns: dict[str, str] = {}  # request id -> its Leyline namespace's salt
        pool_blocks = int(self.block_pool.num_gpu_blocks)
        self.leyline_rows = HeldRowsTable(
            lambda blk: self.block_pool.free_blocks([blk]),
            max_entries=max(1, pool_blocks // 8),
            protect=lambda ns: self.leyline_pins.holds(ns),  # pinned namespaces are passed over
        )
        rows = BlockRows(self.block_pool.blocks, self.block_size, self.leyline_rows)
        self.leyline_pins = PinTable[str, Watch](
            rows, ttl_from_env(), budget=pool_blocks // 2, ttl_name=TTL_ENV
        )
        self._leyline_swept = time.monotonic()
        self.leyline_sequences = SequenceIndex()  # rows inside cached full blocks
        allocate = self.kv_cache_manager.allocate_slots

        def allocate_slots(*args: Any, **kwargs: Any) -> Any:
            """vLLM's allocation; while it finds the pool short, the oldest pin gives way."""
            while True:
                out = allocate(*args, **kwargs)
                if out is not None or not self.leyline_break_pin():
                    return out

        self.kv_cache_manager.allocate_slots = allocate_slots
        from leyline_agent.vllm_plugin.connector import LeylineConnector

        self.leyline_connector = (
            self.connector if isinstance(self.connector, LeylineConnector) else None
        )
        if self.leyline_connector is not None:
            self.leyline_connector.scheduler = self

    # -- lookups (read-only) ---------------------------------------------------------------
    @property
    def block_pool(self) -> BlockPool:
        return self.kv_cache_manager.block_pool

    def leyline_hashes(
        self, tokens: list[int], salt: str | None, hasher: BlockHasher
    ) -> list[BlockHash]:
        """Block hashes of ``tokens``' full blocks under ``salt`` (vLLM's own hasher)."""
        return list(block_request(tokens, salt, hasher).block_hashes)

    @property
    def leyline_rows_on(self) -> bool:
        """Rows past the last full block can be held and handed over (our connector runs)."""
        return self.leyline_connector is not None

    def leyline_route(self, tokens: list[int], salt: str | None, hasher: BlockHasher) -> str | None:
        """The salt a request of ``tokens`` with ``salt`` is served under (``route_salt``)."""
        first = list(tokens[: self.block_size])

        def holds(s: str) -> bool:
            whole = len(first) == self.block_size
            if whole and self.leyline_cached_blocks(self.leyline_hashes(first, s, hasher)):
                return True
            # the namespace's own rows of the prompt's start, though not a full block: a
            # short prompt's, or T[:s] staged for a head or a FORGET with s in the first block
            return self.leyline_rows_on and self.leyline_rows.holds_start(s, s, first, whole=whole)

        return route_salt(salt, ANONYMOUS_SALT, holds)

    def leyline_cached_blocks(self, hashes: list[BlockHash]) -> list[KVCacheBlock]:
        """The cached blocks of a hash chain, from the first, up to a miss."""
        out = []
        for h in hashes:
            found = self.block_pool.get_cached_block(h, [0])
            if not found:
                break
            out.append(found[0])
        return out

    def leyline_match(self, request: Request, num_local: int) -> RowsMatch | None:
        """Held rows of the request's namespace that extend its local hit (the connector)."""
        ns = self._leyline_ns.get(request.request_id)
        if ns is None or not self.cache_config.enable_prefix_caching:
            return None
        return self.leyline_rows.match(
            ns, request.cache_salt, list(request.all_token_ids), num_local, self.block_size
        )

    def leyline_keep_rows(
        self, ns: str, tokens: list[int], block: KVCacheBlock, salt: str | None, *, touch: bool
    ) -> None:
        """Hold ``block`` as the rows of ``tokens`` past its last full block (``touch``: take
        a reference for the table; otherwise the caller's reference passes to it)."""
        if not self.leyline_rows_on or len(tokens) % self.block_size == 0:
            if not touch:
                self.block_pool.free_blocks([block])
            return
        if touch:
            self.block_pool.touch([block])
        base = (len(tokens) // self.block_size) * self.block_size
        self.leyline_rows.add(ns, HeldRows(tuple(tokens), base, block, salt))

    # -- vLLM overrides ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.cache_salt is None or is_leyline_salt(request.cache_salt):
            self._leyline_ns[request.request_id] = request.cache_salt or ANONYMOUS_SALT
        hasher, ids = getattr(request, "_block_hasher", None), request.prompt_token_ids
        if self.cache_config.enable_prefix_caching and hasher is not None and ids is not None:
            routed = self.leyline_route(list(ids), request.cache_salt, hasher)
            if routed != request.cache_salt:  # another salt: another hash chain
                request.cache_salt, request.block_hashes = routed, []
                request.update_block_hashes()
        extra = request.sampling_params.extra_args if request.sampling_params else None
        if extra and extra.get(HOLD_KEY):
            self._leyline_heads[request.request_id] = str(extra[HOLD_KEY])
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        if self.leyline_connector is not None:
            self.leyline_connector.leyline_step_done()
        out = super().schedule(*args, **kwargs)
        for new in out.scheduled_new_reqs:
            self._leyline_cached.setdefault(new.req_id, int(new.num_computed_tokens))
            ns = self._leyline_ns.get(new.req_id)
            if ns is not None and self.leyline_pins.watches(ns):
                if not new.req_id.startswith("leyline-"):  # a directive's own requests
                    prompt = self.requests[new.req_id].prompt_token_ids or []
                    self.leyline_apply(self.leyline_pins.scheduled(ns, prompt))
        self._leyline_expire()
        return out

    def _free_request(
        self, request: Request, delay_free_blocks: bool = False
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        rid = request.request_id
        cached = self._leyline_cached.pop(rid, 0)
        hold_id = self._leyline_heads.pop(rid, None)
        ns = self._leyline_ns.pop(rid, None)
        if ns is not None and self.cache_config.enable_prefix_caching:
            if hold_id is None:
                self._leyline_keep_request_rows(request, ns)
            n = int(request.num_computed_tokens)
            hashes = list(request.block_hashes[: n // self.block_size])
            self.leyline_sequences.record(ns, request.cache_salt, request.all_token_ids[:n], hashes)
            if rid.startswith("leyline-forget-"):  # T' of a FORGET
                self._leyline_pin_request(request, ns)
        if hold_id is not None:
            blocks = list(self.kv_cache_manager.get_blocks(rid).blocks[0])
            self.leyline_hold(hold_id, blocks, request.cache_salt, cached)
        elif not rid.startswith("leyline-forget-"):  # a FORGET's re-prefill: the route counts it
            self.leyline_served.count_generation(
                request.num_prompt_tokens, cached, request.num_output_tokens
            )
        return super()._free_request(request, delay_free_blocks)

    def _leyline_keep_request_rows(self, request: Request, ns: str) -> None:
        """Hold the request's rows past its last full block and, when its answer filled the
        block its prompt ended in, that block too, as the prompt's own last rows: a splice
        whose ``T`` is the prompt (a chat turn's drift) finds them there, where vLLM's hash
        lookup cannot (the block's hash covers the answer's tokens too)."""
        if not self.leyline_rows_on:
            return
        n, bs = int(request.num_computed_tokens), self.block_size
        blocks = self.kv_cache_manager.get_blocks(request.request_id).blocks[0]
        p = int(request.num_prompt_tokens)
        j = p // bs
        if p % bs and (j + 1) * bs <= n and j < len(blocks):
            tokens = tuple(request.all_token_ids[: (j + 1) * bs])
            self.block_pool.touch([blocks[j]])
            self.leyline_rows.add(ns, HeldRows(tokens, j * bs, blocks[j], request.cache_salt))
        j = n // bs
        if n % bs and j < len(blocks):
            tokens = list(request.all_token_ids[:n])
            self.leyline_keep_rows(ns, tokens, blocks[j], request.cache_salt, touch=True)

    # -- holds ----------------------------------------------------------------------------
    def leyline_hold(
        self, hold_id: str, blocks: list[KVCacheBlock], salt: str | None, num_cached_tokens: int
    ) -> None:
        """Keep ``blocks`` with one reference each under ``hold_id`` (``leyline_release``)."""
        self.block_pool.touch(blocks)
        self.leyline_held[hold_id] = Held(list(blocks), salt, num_cached_tokens)

    def leyline_release(self, hold_id: str) -> bool:
        held = self.leyline_held.pop(hold_id, None)
        if held is None:
            return False
        self.block_pool.free_blocks(reversed(held.blocks))  # the tail is evicted first
        return True

    def _leyline_expire(self) -> None:
        """Pins past their TTL stop holding; holds whose directive never came back (client
        gone, crash) are released; once a second, unheld pins are checked for lost rows."""
        now = time.monotonic()
        if self.leyline_pins.num_pins:
            self.leyline_apply(self.leyline_pins.expire())
            if now - self._leyline_swept > LOSS_SWEEP_S:
                self._leyline_swept = now
                self.leyline_pins.count_lost()
        if not self.leyline_held and not len(self.leyline_rows):
            return
        self.leyline_rows.expire(now)
        for hid in [h for h, v in self.leyline_held.items() if now - v.since > HOLD_TTL_S]:
            self.leyline_release(hid)

    def leyline_drop(self, block_hash: BlockHash) -> int:
        """Drop every cached block registered under ``block_hash`` (hash only: a block in
        use stays readable by its request)."""
        key = make_block_hash_with_group_id(block_hash, 0)
        n = 0
        while (blk := self.block_pool.cached_block_hash_to_block.get_one_block(key)) is not None:
            self.block_pool.evict_blocks({blk.block_id})
            n += 1
            if n > 64:  # a hash maps to few blocks; never loop on a bug
                break
        return n

    # -- pins -----------------------------------------------------------------------------
    def leyline_pin(
        self,
        ns: str,
        tokens: list[int],
        blocks: list[KVCacheBlock],
        salt: str | None,
        partial: KVCacheBlock | None,
    ) -> None:
        """``tokens`` (``T'``, full ``blocks`` cached under ``salt``, rows past them in the
        held block ``partial`` or none) is ``ns``'s latest splice result: pinned."""
        n_full = len(tokens) // self.block_size
        full = list(takewhile(lambda b: b.block_hash is not None, blocks[:n_full]))
        if len(full) < n_full:  # what is not cached cannot be held: the cached head is
            log.warning("leyline pin: %d of T's %d full blocks cached", len(full), n_full)
            tokens, partial = tokens[: len(full) * self.block_size], None
        watch = Watch(
            tuple(tokens),
            tuple(b.block_id for b in full),
            tuple(b.block_hash for b in full),
            salt,
            None if partial is None else int(partial.block_id),
        )
        self.leyline_apply(self.leyline_pins.pin(ns, watch, watch.block_ids, len(watch.block_ids)))

    def leyline_break_pin(self) -> bool:
        """The oldest pin that holds blocks gives them back (False: none holds any)."""
        refs = self.leyline_pins.break_oldest()
        self.leyline_apply(refs)
        return bool(refs.give_back)

    def _leyline_pin_request(self, request: Request, ns: str) -> None:
        """A FORGET's re-prefill of ``T'`` ends: its full blocks (and the rows past them,
        which ``_leyline_keep_request_rows`` holds) are the namespace's pinned result."""
        tokens = list(request.prompt_token_ids or [])
        blocks = list(self.kv_cache_manager.get_blocks(request.request_id).blocks[0])
        base = (len(tokens) // self.block_size) * self.block_size
        held = self.leyline_rows.find(ns, request.cache_salt, tokens, base)
        partial = held.block if held is not None and len(held.tokens) == len(tokens) else None
        self.leyline_pin(ns, tokens, blocks, request.cache_salt, partial)

    def leyline_apply(self, refs: Refs) -> None:
        """Take, then give back, the block-pool references a pin-table answer names (every
        answer of ``leyline_pins`` that carries ``Refs`` passes through here)."""
        if refs.take:
            self.block_pool.touch([self.block_pool.blocks[i] for i in refs.take])
        if refs.give_back:
            self.block_pool.free_blocks(self.block_pool.blocks[i] for i in refs.give_back)
