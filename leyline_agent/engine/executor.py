"""Execute a ``DirectivesRequest`` on the engine: validate, compile, plan, then mutate.

Order of work (nothing is mutated until every check has passed):

1. token form: check ``tokens`` and every replacement id; compile text replacements with
   the tokenizer; ``plan_batch`` (spans in range, no overlaps) -> right-to-left order.
   message form: render old/new with the chat template (``add_generation_prompt=False``),
   diff tokens per message (``compile.diff_spans``), clip spans to the cached prefix
   (``compile.clip_to_cached``).
2. match the base ``T`` in the radix tree (pure). Token form: every span must end inside
   the cached prefix of ``T``; message form: something of the conversation must be cached.
   Otherwise ``CacheMissError`` (counted in ``directive_errors``), or with ``fallback`` a
   counted fallback: nothing is executed and the next request re-prefills.
3. ``plan_splice`` (pure), then ``execute_splice`` on fresh slots, insert ``T'`` (the part
   over the cached base) into the tree, free scratch slots, evict to the budget.

Tokens of ``T`` beyond its cached prefix are carried into the answer's ``tokens`` but not
cached: the next request prefills them, as it would have anyway.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from leyline_agent.directives import Directive, plan_batch, splice_tokens
from leyline_agent.directives.compile import clip_to_cached, diff_spans
from leyline_agent.engine.cache.radix import Match
from leyline_agent.engine.splice import SplicePlan, execute_splice, plan_splice
from leyline_agent.errors import CacheMissError, DirectiveError
from leyline_agent.namespaces import Namespace
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

if TYPE_CHECKING:
    from leyline_agent.engine.engine import Engine

__all__ = ["apply_request"]


class _Backend:
    """The splice backend: the engine's runner and pool."""

    def __init__(self, engine: Engine) -> None:
        self.e = engine

    def prefill_into_slots(
        self, prefix_slots: Sequence[int], token_ids: Sequence[int]
    ) -> list[int]:
        return self.e.runner.prefill_into_slots(prefix_slots, token_ids)

    def rotate_into_fresh(self, src: Sequence[int], delta: int) -> list[int]:
        dst = self.e.allocator.alloc(len(src))
        try:
            self.e.pool.copy_rotated(src, dst, delta)
        except BaseException:
            self.e.allocator.free(dst)
            raise
        return dst


def _compile_token_form(
    engine: Engine, req: DirectivesRequest
) -> tuple[list[int], list[Directive]]:
    tokens = engine.check_ids(req.tokens or [], "tokens")
    compiled = []
    for i, d in enumerate(req.directives or []):
        if isinstance(d.replacement, str):
            ids = list(engine.tokenizer.encode(d.replacement, add_special_tokens=False))
            d = Directive(start=d.start, end=d.end, replacement=ids, mode=d.mode)
        engine.check_ids(d.replacement, f"directives[{i}].replacement", allow_empty=True)
        compiled.append(d)
    return tokens, compiled


def apply_request(engine: Engine, req: DirectivesRequest, ns: Namespace) -> DirectivesResponse:
    """Execute ``req`` in namespace ``ns``: its base is looked up as ``ns`` sees the cache
    (its own spliced rows first), and ``T'`` is written back as ``ns``'s (``radix.py``)."""
    t0 = time.perf_counter()
    cache = engine.cache
    if req.tokens is not None:
        tokens, compiled = _compile_token_form(engine, req)
        order = plan_batch(compiled, seq_len=len(tokens))
        new_tokens = splice_tokens(tokens, order)
        m = cache.match(tokens, ns)
        for i, d in enumerate(compiled):
            if d.end > m.length or m.length == 0:
                return _miss(
                    engine, req, ns, new_tokens, order,
                    f"directives[{i}]: span [{d.start}, {d.end}) of 'tokens' is not cached "
                    f"(the prefix cache holds its first {m.length} of {len(tokens)} tokens)",
                )  # fmt: skip
        base = tokens[: m.length]
    else:
        old = engine.render(req.old_messages or [], req.tools, False, where="old_messages")
        new_tokens = engine.render(req.new_messages or [], req.tools, False, where="new_messages")
        spans = diff_spans(old, new_tokens, engine.message_boundary_id)
        if not spans:
            return _outcome(new_tokens, [], plan_splice(old, []), "noop", 0, t0)
        m = cache.match(old, ns)
        kept = clip_to_cached(spans, m.length)
        if m.length == 0 or not kept:
            return _miss(
                engine, req, ns, new_tokens, [],
                f"old_messages: the edits start at token {spans[0].start} but only the first "
                f"{m.length} tokens of the rendered conversation are cached",
            )  # fmt: skip
        order = plan_batch(
            [Directive(start=s.start, end=s.end, replacement=s.replacement, mode=req.mode)
             for s in kept],
            seq_len=m.length,
        )  # fmt: skip
        base = old[: m.length]
    cache.arrive(ns)
    plan = plan_splice(base, order, exact_len=m.exact_len)
    if order:
        _execute(engine, plan, m, ns)
    st = engine.counters(ns.tenant)
    for k, v in plan.splices.items():
        st.splices[k] = st.splices.get(k, 0) + v
    st.rotated_tokens += plan.rotated_tokens
    outcome = "applied" if order else "noop"
    return _outcome(new_tokens, order, plan, outcome, m.length, t0)


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
    engine: Engine, req: DirectivesRequest, ns: Namespace, new_tokens: list[int],
    order: list[Directive], msg: str,
) -> DirectivesResponse:  # fmt: skip
    st = engine.counters(ns.tenant)
    if not req.fallback:
        st.directive_errors += 1
        raise CacheMissError(msg)
    st.fallbacks += 1
    return DirectivesResponse(outcome="fallback", tokens=new_tokens, applied=order, fallback=True)


def _execute(engine: Engine, plan: SplicePlan, m: Match, ns: Namespace) -> None:
    cache = engine.cache
    cache.hold(m)
    try:
        res = execute_splice(plan, m.slots, _Backend(engine))
    except BaseException as e:
        engine.allocator.free(getattr(e, "fresh_slots", []))
        raise
    finally:
        cache.release(m)
    if len(res.slots) != len(plan.tokens):
        raise DirectiveError("internal: splice produced the wrong number of slots")
    cache.insert(plan.tokens, res.slots, res.fresh, ns, plan.exact_len)
    cache.pin(ns, plan.tokens)
    engine.evict()
