"""Execute a ``DirectivesRequest`` on the engine: compile, decide, plan, then mutate.

Order of work (nothing is mutated until every check has passed):

1. ``directives.pipeline.compile_request``: token form: ``tokens`` and every replacement id
   checked, text replacements tokenized, ``plan_batch`` (spans in range, no overlaps) ->
   right-to-left order; message form: old/new rendered with the chat template and diffed
   per message.
2. match the base ``T`` in the radix tree (pure), then ``pipeline.decide``: a miss
   (``CacheMissError``, counted in ``directive_errors``, or with ``fallback`` a counted
   fallback: nothing is executed and the next request re-prefills), a ``noop``, or a
   ``Plan`` (message-form spans clipped to the cached prefix: see ``pipeline``).
3. ``plan_splice`` (pure), then ``execute_splice`` on fresh slots, REPAIR's selected rows
   recomputed in place in those fresh slots (``repair.py``), insert ``T'`` (the part over
   the cached base) into the tree, free scratch slots, evict to the budget.

Scheduling: steps 1-2 and the plan run between two steps under the engine lock, which then
holds the matched base (``PrefixCache.hold``) and lets go. The prefills of ``R`` run as
sequences of the step loop (``Stepper.prefill``), chunked and batched with other sessions'
decodes, while this thread waits; the tail move (``KVPool.copy_rotated``) runs under the
lock in sections of ``MOVE_ROWS`` rows, a step between two, and the insert, pin and eviction
under the lock again. A splice that fails frees its fresh slots and
caches nothing. A caller that already holds the lock (``Stepper.exclusive``) runs the whole
directive inline, the prefills included: no step runs meanwhile.

Tokens of ``T`` beyond its cached prefix are carried into the answer's ``tokens`` but not
cached: the next request prefills them, as it would have anyway. Every answer is counted
in the namespace's tenant's ``Counters`` (``count_directive``).

Steps 1-2 and the counting are ``directives.service.run_directive``'s, the same on every
backend; ``EngineDirectives`` is the engine's ``DirectiveBackend`` for them (hold the matched
base, execute a plan, release, count under the lock), driven in the caller's thread.

The executor sees the engine through ``SpliceHost`` (its cache, runner, pool, tokenizer,
counters, step loop), so it never imports the engine module (no import circle). Its
``_Backend`` is the engine's ``directives.backend.SpliceBackend``: lookup, hold and release
on the prefix cache, the row writes, and the commit of ``T'``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from leyline_agent.directives.core import Mode
from leyline_agent.directives.modes import executed_by
from leyline_agent.directives.pipeline import Plan, applied_answer
from leyline_agent.directives.service import run_directive, run_inline
from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.cache.kv_pool import KVPool
from leyline_agent.engine.cache.prefix_cache import FlushReport, PrefixCache
from leyline_agent.engine.cache.radix import Match
from leyline_agent.engine.model.runner import ModelRunner
from leyline_agent.engine.repair import repair_rows
from leyline_agent.engine.splice import SplicePlan, execute_splice, plan_splice
from leyline_agent.engine.stepper import Stepper
from leyline_agent.errors import DirectiveError
from leyline_agent.namespaces import Namespace
from leyline_agent.wire import Counters, DirectivesRequest, DirectivesResponse

__all__ = [
    "GPU_MOVE_ROWS",
    "MOVE_ROWS",
    "ROW_OPS",
    "EngineDirectives",
    "HeldBase",
    "SpliceHost",
    "apply_request",
    "move_rows_for",
]

# The row operations the engine implements (``directives.modes``): every mode's.
ROW_OPS = frozenset({"move", "prefill", "recompute"})

MOVE_ROWS = 1024  # tail rows moved per locked section (6k rows: 3-6 ms at once on CPU)
# On a GPU a 16k-row tail moves in well under a millisecond, and each section costs a lock
# hand-off and the rotation plan's checks, which wait for the device (gpu_check's profile of
# an AMORTIZE at 33k: 16 sections, 356 stream syncs): the tail moves in one section there.
GPU_MOVE_ROWS = 1 << 20


def move_rows_for(device_type: str) -> int:
    """Tail rows moved per locked section on a device type (``torch.device.type``)."""
    return GPU_MOVE_ROWS if device_type == "cuda" else MOVE_ROWS


class SpliceHost(Protocol):
    """What executing a directive needs of the engine (``engine.Engine`` is one)."""

    tokenizer: Any
    vocab_size: int
    message_boundary_id: int | None
    cache: PrefixCache
    runner: ModelRunner
    allocator: SlotAllocator
    pool: KVPool
    stepper: Stepper
    repair_budget: float  # REPAIR's fraction of a tail where a directive gives none
    repair_selector: str  # which tail rows REPAIR recomputes (``directives.repair``)

    def counters(self, tenant: str) -> Counters: ...

    def evict(self) -> None: ...

    def flush(self, tenant: str) -> FlushReport:
        """Empty ``tenant``'s part of the cache (takes the engine lock)."""
        ...


class _Backend:
    """The engine's ``SpliceBackend`` in namespace ``ns``: lookup, hold, release and commit
    on the prefix cache (the caller holds the engine lock for them); prefills through the
    step loop (inline if the caller holds the engine lock), row moves on the pool under
    the lock. ``held`` is the match whose lock keeps the base rows while the prefills read
    them."""

    def __init__(self, host: SpliceHost, ns: Namespace) -> None:
        self.host, self.ns = host, ns
        self.held: Match | None = None

    def lookup(self, tokens: Sequence[int]) -> Match:
        return self.host.cache.match(tokens, self.ns)

    def hold(self, held: Match) -> None:
        self.host.cache.hold(held)
        self.held = held

    def release(self, held: Match) -> None:
        self.host.cache.release(held)
        self.held = None

    def commit(
        self, tokens: Sequence[int], slots: Sequence[int], fresh: Sequence[int], exact_len: int
    ) -> None:
        """``T'`` into the tree as ``ns``'s, pinned for the session's next request; then
        the cache is evicted back to its budget."""
        cache = self.host.cache
        cache.insert(tokens, slots, fresh, self.ns, exact_len)
        cache.pin(self.ns, tokens)
        self.host.evict()

    def prefill_into_slots(
        self, prefix_slots: Sequence[int], token_ids: Sequence[int], prefix_ids: Sequence[int]
    ) -> list[int]:
        stepper = self.host.stepper
        if stepper.holds_lock():
            return self.host.runner.prefill_into_slots(prefix_slots, token_ids)
        assert self.held is not None, "prefills read a held base"
        prefix = Match(len(prefix_slots), list(prefix_slots), self.held.node)
        return stepper.prefill(prefix, list(prefix_ids), list(token_ids), self.ns)

    def rotate_into_fresh(self, src: Sequence[int], delta: int | Sequence[int]) -> list[int]:
        """Move ``src`` into one fresh run, ``MOVE_ROWS`` rows per locked section: a step of
        the other sequences runs between two sections, so a long tail adds about a section's
        copy to a stream's gap, not the whole move's."""
        stepper, alloc = self.host.stepper, self.host.allocator
        rows = move_rows_for(self.host.pool.device.type)
        with stepper.exclusive():
            dst = alloc.alloc(len(src))
        try:
            for i in range(0, len(src), rows):
                part = delta if isinstance(delta, int) else delta[i : i + rows]
                with stepper.exclusive():
                    self.host.pool.copy_rotated(src[i : i + rows], dst[i : i + rows], part)
        except BaseException:
            with stepper.exclusive():
                alloc.free(dst)
            raise
        return dst


def apply_request(
    host: SpliceHost, req: DirectivesRequest, ns: Namespace, *, per_directive: bool = False
) -> DirectivesResponse:
    """Execute ``req`` in namespace ``ns``: its base is looked up as ``ns`` sees the cache
    (its own spliced rows first), and ``T'`` is written back as ``ns``'s (``radix.py``).
    ``per_directive``: run a batch's steps one by one (``splice.py``; for measurements).
    The steps are ``directives.service.run_directive``'s over ``EngineDirectives``, in this
    thread; the engine lock is taken where it is needed (module doc)."""
    backend = EngineDirectives(host, per_directive=per_directive)
    return run_inline(
        run_directive(req, ns, backend, host.tokenizer, host.vocab_size, host.message_boundary_id)
    )


@dataclass(slots=True)
class HeldBase:
    """The matched base, held (``PrefixCache.hold``) until released once."""

    match: Match
    released: bool = False

    @property
    def length(self) -> int:
        return self.match.length


class EngineDirectives:
    """The engine's ``directives.service.DirectiveBackend``. Its coroutines never suspend:
    they run in the caller's thread (``run_inline``), taking the engine lock for the cache
    and letting the step loop run between the sections of a splice (module doc)."""

    def __init__(self, host: SpliceHost, *, per_directive: bool = False) -> None:
        self.host = host
        self.per_directive = per_directive

    @property
    def executes(self) -> frozenset[Mode]:
        return executed_by(ROW_OPS)

    async def hold(self, base: list[int], ns: Namespace) -> HeldBase:
        backend = _Backend(self.host, ns)
        with self.host.stepper.exclusive():
            m = backend.lookup(base)
            backend.hold(m)
        return HeldBase(m)

    async def execute(self, plan: Plan, held: HeldBase, ns: Namespace) -> DirectivesResponse:
        host, backend = self.host, _Backend(self.host, ns)
        backend.held = held.match
        with host.stepper.exclusive():
            host.cache.arrive(ns)  # the session's request: its pin ends
            splice = plan_splice(
                plan.base, plan.order, exact_len=held.match.exact_len,
                repair_budget=host.repair_budget, selector=host.repair_selector,
            )  # fmt: skip
        ready = _Ready(splice, held.match, plan)
        held.released = True  # _execute lets it go, on success as on failure
        _execute(host, backend, ready, self.per_directive)
        return ready.response()

    async def release(
        self, held: HeldBase, ns: Namespace, answer: DirectivesResponse | None
    ) -> None:
        with self.host.stepper.exclusive():
            if not held.released:
                self.host.cache.release(held.match)
                held.released = True
            if answer is not None and answer.outcome == "noop":
                self.host.cache.arrive(ns)  # the session's request: its pin ends

    async def count(self, ns: Namespace, update: Callable[[Counters], None]) -> None:
        with self.host.stepper.exclusive():
            update(self.host.counters(ns.tenant))

    async def flush(self, tenant: str) -> FlushReport:
        return self.host.flush(tenant)


@dataclass(slots=True)
class _Ready:
    """A decided, planned splice: what ``_execute`` runs and what it answers."""

    splice: SplicePlan
    match: Match
    plan: Plan

    def response(self) -> DirectivesResponse:
        sp = self.splice
        return applied_answer(
            self.plan, splices=sp.splices, reused=sp.reused_tokens,
            prefilled=sp.prefilled_tokens, rotated=sp.rotated_tokens,
            repaired=sp.repaired_tokens,
        )  # fmt: skip


def _execute(host: SpliceHost, backend: _Backend, ready: _Ready, per_directive: bool) -> None:
    """Run the plan on fresh slots (``ready.match`` is held), then write ``T'`` into the
    cache under the lock; on failure free every fresh slot and cache nothing."""
    plan, m = ready.splice, ready.match
    res = None
    try:
        res = execute_splice(plan, m.slots, backend, per_directive=per_directive)
        if plan.repair_rows:
            repair_rows(
                host.runner, plan.tokens, res.slots, plan.repair_rows, res.fresh,
                host.stepper.exclusive,
            )  # fmt: skip
    except BaseException as e:
        with host.stepper.exclusive():
            host.allocator.free(res.fresh if res is not None else getattr(e, "fresh_slots", []))
            backend.release(m)
        raise
    with host.stepper.exclusive():
        backend.release(m)
        if len(res.slots) != len(plan.tokens):
            host.allocator.free(res.fresh)
            raise DirectiveError("internal: splice produced the wrong number of slots")
        backend.commit(plan.tokens, res.slots, res.fresh, plan.exact_len)
