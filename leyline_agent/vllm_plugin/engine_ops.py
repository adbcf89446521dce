"""EngineCore side: ``EngineCore.leyline_rpc(request_json) -> answer_json``.

The API server reaches the EngineCore process with vLLM's utility calls
(``engine_client.engine_core.call_utility_async(name, *args)`` -> ``getattr(engine_core,
name)(*args)``), which vLLM runs in its busy loop between two steps: no forward pass runs
while an op does. The general plugin adds this one method to ``EngineCore``. The ops
(``directives.engine_rpc``), on vLLM's block pool:

- ``lock``: ``T``'s cached full blocks in its routed namespace and, when the namespace
  holds them, the rows of its partial last block (held rows, or the cached full block a
  longer sequence left, ``directives.sequences``), held with a reference so no eviction can
  take them before the splice (a miss holds nothing). ``stage=s``: the rows
  ``T[block_start(s):s]`` are also held for the namespace as the rows of ``T[:s]``, so the
  request that follows (a head ``T[:s] + R``, a FORGET's ``T'``) is handed them.
- ``splice``: the plan (``directives.block_plan``) from the locked ``T`` and the held head
  (or, with no ``hold_id``, ``R``'s rows to compute), fresh blocks, then one
  ``leyline_splice_rows`` on every worker: the row copies, then the rows computed in place
  (``R``'s without a head; ``repair``: REPAIR's, checked to be fresh before the first
  write), ``T'``'s full
  blocks registered under its hash chain in the session's namespace (a block already
  registered there under the same hash is dropped: the latest directive wins), the rows past
  them held for the session's next request, references released; ``T'`` is the namespace's
  pinned result, replacing its last one.
- ``forget``: (``stage=T``: first ``lock(T, stage=start, hold=False)``) drop the session's
  cached blocks and held rows of ``T'`` past ``start``, so that the FORGET's normal request
  computes them again; that request's ``T'`` is pinned when it ends (``scheduler``).
- ``flush``: every pin and watch is dropped, then every cached block no request (or
  directive's hold) holds leaves the prefix cache.

The replies, errors included, are ``engine_rpc.serve_op``'s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from leyline_agent.directives.block_plan import (
    fill_rows,
    plan_block_splice,
    repair_rows,
    row_copies,
)
from leyline_agent.directives.engine_rpc import (
    ArriveAnswer,
    ArriveOp,
    DescribeAnswer,
    DescribeOp,
    FlushAnswer,
    FlushOp,
    ForgetAnswer,
    ForgetOp,
    LockAnswer,
    LockOp,
    Op,
    ReleaseAnswer,
    ReleaseOp,
    SpliceAnswer,
    SpliceOp,
    StatsAnswer,
    StatsOp,
    serve_op,
)
from leyline_agent.errors import CacheMissError, RuntimeUnavailableError
from leyline_agent.vllm_plugin.cache_layout import PLAIN_SPECS
from leyline_agent.vllm_plugin.namespace import is_leyline_salt

if TYPE_CHECKING:
    from vllm.v1.engine.core import EngineCore

    from leyline_agent.vllm_plugin.scheduler import LeylineScheduler

__all__ = ["leyline_rpc"]


def leyline_rpc(engine: EngineCore, request_json: str) -> str:
    """The method the general plugin installs on ``EngineCore`` (``self`` = the engine)."""
    return serve_op(engine, _OPS, request_json)


def _scheduler(engine: EngineCore) -> LeylineScheduler:
    from leyline_agent.vllm_plugin.scheduler import LeylineScheduler

    sched = engine.scheduler
    if not isinstance(sched, LeylineScheduler):
        raise RuntimeUnavailableError(
            f"scheduler_cls: the engine runs {type(sched).__name__}; start vLLM with "
            "VLLM_PLUGINS=leyline (or --scheduler-cls "
            "leyline_agent.vllm_plugin.scheduler.LeylineScheduler)"
        )
    return sched


def _describe(engine: EngineCore, op: DescribeOp) -> DescribeAnswer:
    cfg = engine.vllm_config
    out: dict[str, object] = {"problem": None, "field": None}
    try:
        sched = _scheduler(engine)
        out["block_size"] = sched.block_size
        out["held_rows"] = sched.leyline_rows_on  # rows past a last full block are kept
        if cfg.model_config.use_mla and not cfg.cache_config.enable_prefix_caching:
            raise RuntimeUnavailableError(
                "enable_prefix_caching: this MLA model runs with prefix caching off (vLLM turns "
                "it off for MLA on CPUs without AMX): nothing to splice"
            )
        if not cfg.cache_config.enable_prefix_caching:
            raise RuntimeUnavailableError("enable_prefix_caching: prefix caching is off")
        groups = sched.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise RuntimeUnavailableError(
                f"kv_cache_groups: {len(groups)} KV cache groups (hybrid model); one supported"
            )
        spec = groups[0].kv_cache_spec
        if type(spec).__name__ not in PLAIN_SPECS:
            raise RuntimeUnavailableError(
                f"kv_cache_spec: {type(spec).__name__}; only full attention and MLA are supported"
            )
        hash_bs = engine.vllm_config.cache_config.block_size
        if spec.block_size != sched.block_size or hash_bs != sched.block_size:
            raise RuntimeUnavailableError(
                f"block_size: scheduler {sched.block_size}, KV spec {spec.block_size}, "
                f"cache config {hash_bs}: the block size must be one"
            )
        workers = engine.collective_rpc("leyline_describe")
        for w in workers:
            if w.get("problem"):
                raise RuntimeUnavailableError(w["problem"])
            if w.get("block_size") != sched.block_size:
                raise RuntimeUnavailableError(
                    f"block_size: the workers' cache blocks hold {w.get('block_size')} rows, "
                    f"the scheduler's {sched.block_size}"
                )
        out["workers"] = workers
        out["tp"] = len(workers)
    except RuntimeUnavailableError as e:
        out["problem"] = str(e)
        out["field"] = str(e).split(":", 1)[0]
    except AttributeError as e:  # a worker without the extension
        out["problem"] = (
            "worker_extension_cls: the workers lack the Leyline extension "
            f"(leyline_agent.vllm_plugin.worker.LeylineWorkerExtension): {e}"
        )
        out["field"] = "worker_extension_cls"
    out["max_model_len"] = cfg.model_config.max_model_len
    out["model_type"] = getattr(cfg.model_config.hf_config, "model_type", None)
    out["vocab_size"] = cfg.model_config.get_vocab_size()
    return DescribeAnswer.model_validate(out)


def _lock(engine: EngineCore, op: LockOp) -> LockAnswer:
    tokens, salt, stage = list(op.tokens), op.salt, op.stage
    sched = _scheduler(engine)
    hasher, bs = engine.request_block_hasher, sched.block_size
    routed = sched.leyline_route(tokens, salt, hasher)
    hashes = sched.leyline_hashes(tokens, routed, hasher)
    blocks = sched.leyline_cached_blocks(hashes)
    rows = len(blocks) * bs
    ns = salt if is_leyline_salt(salt) else None
    if ns is not None and sched.leyline_rows_on:
        partial = sched.leyline_rows.find(ns, routed, tokens, rows)
        if partial is not None:
            blocks, rows = [*blocks, partial.block], len(partial.tokens)
        elif rows < len(tokens):  # rows inside a cached full block that goes on
            ext = sched.leyline_sequences.extension(ns, routed, tokens, hashes[: len(blocks)], bs)
            found = sched.leyline_cached_blocks([ext.block_hash]) if ext is not None else []
            if ext is not None and found:
                blocks, rows = [*blocks, *found], rows + ext.num_rows
    lock_id = None
    if blocks:
        lock_id = "lock-" + uuid.uuid4().hex
        sched.leyline_hold(lock_id, blocks, routed, rows)
        if ns is not None and stage is not None and 0 < stage <= rows and stage % bs:
            sched.leyline_keep_rows(ns, tokens[:stage], blocks[stage // bs], routed, touch=True)
        if not op.hold:
            sched.leyline_release(lock_id)
            lock_id = None
    return LockAnswer(lock_id=lock_id, cached_tokens=rows, salt=routed)


def _release(engine: EngineCore, op: ReleaseOp) -> ReleaseAnswer:
    sched = _scheduler(engine)
    return ReleaseAnswer(released=sum(bool(sched.leyline_release(i)) for i in op.ids if i))


def _splice(engine: EngineCore, op: SpliceOp) -> SpliceAnswer:
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from leyline_agent.vllm_plugin.scheduler import block_request

    t0 = time.perf_counter()
    sched = _scheduler(engine)
    pool, bs, salt, tokens = sched.block_pool, sched.block_size, op.salt, list(op.tokens)
    try:
        head = sched.leyline_held.get(op.hold_id) if op.hold_id else None
        if op.hold_id and head is None:
            raise CacheMissError("head: the directive's head request left no blocks (evicted?)")
        base = sched.leyline_held.get(op.lock_id) if op.lock_id else None
        plan = plan_block_splice(
            bs, tokens, op.start, op.end, list(op.replacement),
            [b.block_id for b in base.blocks] if base is not None else [],
            [b.block_id for b in head.blocks] if head is not None else None,
            t_in_target=base is not None and base.salt == salt,
            head_in_target=head is not None and head.salt == salt,
            t_rows=base.num_cached_tokens if base is not None else 0,
            hold_partial=sched.leyline_rows_on,
        )  # fmt: skip
        repair = op.repair.model_dump() if op.repair is not None else None
        rows = repair_rows(plan, tokens, op.start, op.end, len(op.replacement), repair, bs)
        filled = fill_rows(plan, op.start, len(op.replacement)) if head is None else []
        owner = block_request(plan.full_tokens, salt, engine.request_block_hasher, "leyline-splice")
        n_full = len(owner.block_hashes)
        for j, src in enumerate(plan.blocks[:n_full]):  # a reused block is T''s block j
            key = make_block_hash_with_group_id(owner.block_hashes[j], 0)
            if src.reuse is not None and pool.blocks[src.reuse].block_hash != key:
                raise RuntimeUnavailableError(f"block {j}: reused block has another hash")
        while plan.num_new_blocks > pool.get_num_free_blocks() and sched.leyline_break_pin():
            pass  # the pool is short: the oldest pins give way, as for any allocation
        if plan.num_new_blocks > pool.get_num_free_blocks():
            raise RuntimeUnavailableError(
                f"kv_cache: {plan.num_new_blocks} free blocks needed, "
                f"{pool.get_num_free_blocks()} free"
            )
        new = pool.get_new_blocks(plan.num_new_blocks)
        try:
            new_ids = [b.block_id for b in new]
            src, dst, delta = row_copies(plan, new_ids, bs)
            computed = filled + rows  # R's rows (no head), then REPAIR's tail rows
            ids = [plan.tokens[r] for r in computed]
            tblocks = plan.block_ids(new_ids)[: computed[-1] // bs + 1] if computed else []
            engine.collective_rpc(
                "leyline_splice_rows", args=(src, dst, delta, ids, computed, tblocks)
            )
        except Exception:
            pool.free_blocks(new)
            raise
        blocks = [pool.blocks[i] for i in plan.block_ids([b.block_id for b in new])]
        fresh = [b.reuse is None for b in plan.blocks[:n_full]]  # reused ones hold their hash
        for h, is_fresh in zip(owner.block_hashes, fresh, strict=True):
            if is_fresh:
                sched.leyline_drop(h)  # latest wins in the namespace
        sched.leyline_rows.drop_past(salt, plan.tokens, op.start)
        pool.cache_full_blocks(owner, blocks[:n_full], 0, n_full, bs, 0, block_mask=fresh)
        partial = None
        if plan.partial_rows:  # the fresh last block's reference passes to the held rows
            sched.leyline_keep_rows(salt, plan.tokens, blocks[-1], salt, touch=False)
            new, partial = new[:-1], blocks[-1]
        sched.leyline_pin(salt, plan.tokens, blocks[:n_full], salt, partial)  # before the free
        pool.free_blocks(reversed(new))
    finally:
        if op.hold_id:
            sched.leyline_release(op.hold_id)
        if op.lock_id:
            sched.leyline_release(op.lock_id)
    return SpliceAnswer(
        cached_tokens=len(plan.tokens),
        new_blocks=plan.num_new_blocks,
        rotated_tokens=plan.rotated_tokens,
        repaired_tokens=len(rows),
        head_cached_tokens=head.num_cached_tokens if head is not None else op.start,
        elapsed_s=time.perf_counter() - t0,
    )


def _forget(engine: EngineCore, op: ForgetOp) -> ForgetAnswer:
    tokens, start, salt = list(op.tokens), op.start, op.salt
    if op.stage is not None:  # T's rows before ``start`` in its block go to T'
        _lock(engine, LockOp(tokens=op.stage, salt=salt, stage=start, hold=False))
    sched = _scheduler(engine)
    hasher = engine.request_block_hasher
    routed = sched.leyline_route(tokens, salt, hasher)
    dropped = 0
    if is_leyline_salt(routed):  # exact blocks (no salt) hold no spliced rows
        for h in sched.leyline_hashes(tokens, routed, hasher)[start // sched.block_size :]:
            dropped += sched.leyline_drop(h)
    if is_leyline_salt(salt):
        sched.leyline_rows.drop_past(salt, tokens, start)
    return ForgetAnswer(dropped_blocks=dropped, salt=routed)


def _arrive(engine: EngineCore, op: ArriveOp) -> ArriveAnswer:
    sched = _scheduler(engine)
    arrival = sched.leyline_pins.arrive(op.salt)
    sched.leyline_apply(arrival.refs)
    return ArriveAnswer(lost=arrival.lost, watched=arrival.watched)


def _stats(engine: EngineCore, op: StatsOp) -> StatsAnswer:
    sched = _scheduler(engine)
    pool, c = sched.block_pool, sched.leyline_served
    sched.leyline_pins.count_lost()
    return StatsAnswer(
        requests=c.requests,
        prompt_tokens=c.prompt_tokens,
        cached_tokens=c.cached_tokens,
        generated_tokens=c.generated_tokens,
        cache_tokens=len(pool.cached_block_hash_to_block) * sched.block_size,
        cache_capacity_tokens=(pool.num_gpu_blocks - 1) * sched.block_size,
        held=len(sched.leyline_held),
        held_rows=len(sched.leyline_rows),
        pinned_tokens=sched.leyline_pins.pinned() * sched.block_size,
        pin_evictions=sched.leyline_pins.pin_evictions,
    )


def _flush(engine: EngineCore, op: FlushOp) -> FlushAnswer:
    sched = _scheduler(engine)
    pool, bs = sched.block_pool, sched.block_size
    dropped_pins, refs = sched.leyline_pins.clear()  # pins and watches first, then blocks
    sched.leyline_apply(refs)
    sched.leyline_rows.clear()  # held rows are no request's: they go too
    sched.leyline_sequences.forget()
    cached = [b for b in pool.blocks if not b.is_null and b.block_hash is not None]
    free = {b.block_id for b in cached if b.ref_cnt == 0}  # held blocks stay cached
    pool.evict_blocks(free)
    kept = len(cached) - len(free)
    return FlushAnswer(
        flushed_tokens=len(free) * bs, kept_tokens=kept * bs, dropped_pins=dropped_pins
    )


_OPS: dict[type[Op[BaseModel]], Callable[[EngineCore, Any], BaseModel]] = {
    DescribeOp: _describe,
    LockOp: _lock,
    ReleaseOp: _release,
    SpliceOp: _splice,
    ForgetOp: _forget,
    ArriveOp: _arrive,
    StatsOp: _stats,
    FlushOp: _flush,
}
