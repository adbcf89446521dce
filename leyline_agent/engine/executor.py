"""Execute a ``DirectivesRequest`` on the engine: validate, compile, plan, then mutate.

Order of work (nothing is mutated until every check has passed):

1. token form: check ``tokens`` and every replacement id; compile text replacements with
   the tokenizer; ``plan_batch`` (spans in range, no overlaps) -> right-to-left order.
   message form: render old/new with the chat template and diff them per message
   (``directives.compile.message_edits``), clip spans to the cached prefix
   (``directives.compile.clip_to_cached``).
2. match the base ``T`` in the radix tree (pure). Token form: every span must end inside
   the cached prefix of ``T``; message form: every edited span must be cached (with
   ``fallback``, only something of the conversation: the spans are clipped to the cached
   prefix, and what they leave out the next request prefills).
   Otherwise ``CacheMissError`` (counted in ``directive_errors``), or with ``fallback`` a
   counted fallback: nothing is executed and the next request re-prefills.
3. ``plan_splice`` (pure), then ``execute_splice`` on fresh slots, insert ``T'`` (the part
   over the cached base) into the tree, free scratch slots, evict to the budget.

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

The executor sees the engine through ``SpliceHost`` (its cache, runner, pool, tokenizer,
counters, step loop), so it never imports the engine module (no import circle).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from leyline_agent.directives import Directive, plan_batch, splice_tokens
from leyline_agent.directives.compile import (
    clip_to_cached,
    message_edits,
    to_directives,
    token_form,
)
from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.cache.kv_pool import KVPool
from leyline_agent.engine.cache.prefix_cache import PrefixCache
from leyline_agent.engine.cache.radix import Match
from leyline_agent.engine.model.runner import ModelRunner
from leyline_agent.engine.splice import SplicePlan, execute_splice, plan_splice
from leyline_agent.engine.stepper import Stepper
from leyline_agent.errors import CacheMissError, DirectiveError
from leyline_agent.namespaces import Namespace
from leyline_agent.wire import Counters, DirectivesRequest, DirectivesResponse

__all__ = ["MOVE_ROWS", "SpliceHost", "apply_request"]

MOVE_ROWS = 1024  # tail rows moved per locked section (6k rows: 3-6 ms at once on CPU)


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

    def counters(self, tenant: str) -> Counters: ...

    def evict(self) -> None: ...


class _Backend:
    """The splice backend: prefills through the step loop (inline if the caller holds the
    engine lock), row moves on the pool under the lock. ``held`` is the match whose lock
    keeps the base rows while the prefills read them."""

    def __init__(self, host: SpliceHost, held: Match, ns: Namespace) -> None:
        self.host, self.held, self.ns = host, held, ns

    def prefill_into_slots(
        self, prefix_slots: Sequence[int], token_ids: Sequence[int], prefix_ids: Sequence[int]
    ) -> list[int]:
        stepper = self.host.stepper
        if stepper.holds_lock():
            return self.host.runner.prefill_into_slots(prefix_slots, token_ids)
        prefix = Match(len(prefix_slots), list(prefix_slots), self.held.node)
        return stepper.prefill(prefix, list(prefix_ids), list(token_ids), self.ns)

    def rotate_into_fresh(self, src: Sequence[int], delta: int | Sequence[int]) -> list[int]:
        """Move ``src`` into one fresh run, ``MOVE_ROWS`` rows per locked section: a step of
        the other sequences runs between two sections, so a long tail adds about a section's
        copy to a stream's gap, not the whole move's."""
        stepper, alloc = self.host.stepper, self.host.allocator
        with stepper.exclusive():
            dst = alloc.alloc(len(src))
        try:
            for i in range(0, len(src), MOVE_ROWS):
                part = delta if isinstance(delta, int) else delta[i : i + MOVE_ROWS]
                with stepper.exclusive():
                    self.host.pool.copy_rotated(src[i : i + MOVE_ROWS], dst[i : i + MOVE_ROWS], part)
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
    Takes the engine lock itself where it needs it (module doc)."""
    t0 = time.perf_counter()
    with host.stepper.exclusive():
        ready = _prepare(host, req, ns, t0)
        if isinstance(ready, DirectivesResponse):
            host.counters(ns.tenant).count_directive(ready)
            return ready
        host.cache.hold(ready.match)
    _execute(host, ready, ns, per_directive)
    resp = ready.response()
    with host.stepper.exclusive():
        host.counters(ns.tenant).count_directive(resp)
    return resp


@dataclass(slots=True)
class _Ready:
    """A checked, planned splice: what ``_execute`` runs and what it answers."""

    plan: SplicePlan
    match: Match
    new_tokens: list[int]
    order: list[Directive]
    t0: float

    def response(self) -> DirectivesResponse:
        return _outcome(
            self.new_tokens, self.order, self.plan, "applied", self.match.length, self.t0
        )


def _prepare(
    host: SpliceHost, req: DirectivesRequest, ns: Namespace, t0: float
) -> DirectivesResponse | _Ready:
    """Checks, compile and the pure plan (under the lock; nothing is mutated but the
    session's pin ending): the answer if there is nothing to execute, else the plan."""
    cache = host.cache
    if req.tokens is not None:
        tokens, compiled = token_form(
            req.tokens or [], req.directives or [], host.tokenizer, host.vocab_size
        )
        order = plan_batch(compiled, seq_len=len(tokens))
        new_tokens = splice_tokens(tokens, order)
        m = cache.match(tokens, ns)
        for i, d in enumerate(compiled):
            if d.end > m.length or m.length == 0:
                return _miss(
                    host, req, ns, new_tokens, order,
                    f"directives[{i}]: span [{d.start}, {d.end}) of 'tokens' is not cached "
                    f"(the prefix cache holds its first {m.length} of {len(tokens)} tokens)",
                )  # fmt: skip
        base = tokens[: m.length]
    else:
        edits = message_edits(
            host.tokenizer, req.old_messages or [], req.new_messages or [], req.tools,
            host.message_boundary_id,
        )  # fmt: skip
        old, new_tokens, spans = edits.old, edits.new, edits.spans
        if not spans:
            return _outcome(new_tokens, [], plan_splice(old, []), "noop", 0, t0)
        m = cache.match(old, ns)
        kept = clip_to_cached(spans, m.length)
        if m.length == 0 or not kept or (kept != spans and not req.fallback):
            return _miss(
                host, req, ns, new_tokens, [],
                f"old_messages: the edits span tokens [{spans[0].start}, {spans[-1].end}) of "
                f"the rendered conversation but only its first {m.length} tokens are cached "
                "(without fallback no edit is applied in part)",
            )  # fmt: skip
        order = plan_batch(to_directives(kept, req.mode), seq_len=m.length)
        base = old[: m.length]
    cache.arrive(ns)
    plan = plan_splice(base, order, exact_len=m.exact_len)
    if not order:
        return _outcome(new_tokens, order, plan, "noop", m.length, t0)
    return _Ready(plan, m, new_tokens, order, t0)


def _outcome(
    new_tokens: list[int], order: list[Directive], plan: SplicePlan, outcome: str,
    cached_base: int, t0: float,
) -> DirectivesResponse:  # fmt: skip
    return DirectivesResponse(
        outcome=outcome,
        cached_base_tokens=cached_base,
        tokens=new_tokens,
        applied=order,
        splices=plan.splices,
        fallback=False,
        reused_tokens=plan.reused_tokens,
        prefilled_tokens=plan.prefilled_tokens,
        rotated_tokens=plan.rotated_tokens,
        elapsed_s=time.perf_counter() - t0,
    )


def _miss(
    host: SpliceHost, req: DirectivesRequest, ns: Namespace, new_tokens: list[int],
    order: list[Directive], msg: str,
) -> DirectivesResponse:  # fmt: skip
    if not req.fallback:
        host.counters(ns.tenant).directive_errors += 1
        raise CacheMissError(msg)
    return DirectivesResponse(outcome="fallback", tokens=new_tokens, applied=order, fallback=True)


def _execute(host: SpliceHost, ready: _Ready, ns: Namespace, per_directive: bool) -> None:
    """Run the plan on fresh slots (``ready.match`` is held), then write ``T'`` into the
    cache under the lock; on failure free every fresh slot and cache nothing."""
    cache, plan, m = host.cache, ready.plan, ready.match
    backend = _Backend(host, m, ns)
    try:
        res = execute_splice(plan, m.slots, backend, per_directive=per_directive)
    except BaseException as e:
        with host.stepper.exclusive():
            host.allocator.free(getattr(e, "fresh_slots", []))
            cache.release(m)
        raise
    with host.stepper.exclusive():
        cache.release(m)
        if len(res.slots) != len(plan.tokens):
            host.allocator.free(res.fresh)
            raise DirectiveError("internal: splice produced the wrong number of slots")
        cache.insert(plan.tokens, res.slots, res.fresh, ns, plan.exact_len)
        cache.pin(ns, plan.tokens)
        host.evict()
