"""The directive pipeline every backend runs: compile a request, then decide what to do
given how much of its base is cached (pure: no cache, no I/O, no torch).

``leyline serve``'s engine (``engine.executor``), the vLLM plugin (``vllm_plugin.route``) and
the SGLang plugin (``sglang_plugin.executor``) each look the base up in their own cache and
execute a plan their own way; between the two they call these two functions, so one
request gets the same miss message, fallback answer and noop from all of them.

1. ``compile_request(req, tokenizer, vocab_size, message_boundary_id)``, per form:

   - token form (``TokenForm``): ``tokens`` and every replacement id checked against the
     vocabulary, text replacements tokenized (``compile.token_form``), the batch validated
     and put in right-to-left order (``plan_batch``: spans inside ``tokens``, no overlaps),
     and ``T'`` (``splice_tokens``);
   - message form (``MessageForm``): old and new messages rendered with the chat template
     and diffed per message (``compile.message_edits``): the base is the rendered old
     conversation, ``T'`` the rendered new one, and the spans where they differ.

2. ``decide(compiled, cached, req)``, with ``cached`` the length of the base's prefix the
   backend found in its cache (in the request's namespace):

   - token form: every span must end inside the cached prefix (and something must be
     cached), else a miss naming the first directive (in request order) that does not;
     no directives at all is a ``noop``;
   - message form: no span (old and new render alike) is a ``noop``, whatever is cached;
     otherwise the spans are clipped to the cached prefix (``compile.clip_to_cached``). A
     miss when nothing is cached or nothing is left; a partial clip is a miss too unless
     the request asks for ``fallback`` (then the cached part is spliced and the next
     request prefills the rest);
   - a miss raises ``CacheMissError`` (409), or with ``req.fallback`` answers
     ``fallback_answer``: nothing executed, counted, the next request re-prefills;
   - otherwise a ``Plan``: the directives (right to left, never none) on ``T[:cached]``.
     Tokens of ``T`` past the cached prefix are carried into ``T'`` but not spliced: the
     next request prefills them, as it would have anyway.

``applied_answer`` is the answer to an executed plan, from the backend's own counts.
What the backends provide for the steps between (lookup, hold, prefill, row moves,
commit, forget) is ``directives.backend``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from leyline_agent.directives.compile import (
    Span,
    clip_to_cached,
    message_edits,
    to_directives,
    token_form,
)
from leyline_agent.directives.core import Directive, Mode, plan_batch, splice_tokens
from leyline_agent.directives.modes import ALL_MODES, check_modes
from leyline_agent.errors import CacheMissError
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

__all__ = [
    "Compiled",
    "Decision",
    "MessageForm",
    "Plan",
    "TokenForm",
    "applied_answer",
    "compile_request",
    "decide",
    "fallback_answer",
    "noop_answer",
]


@dataclass(frozen=True, slots=True)
class TokenForm:
    """A token-form request compiled: ids checked, replacements as ids."""

    base: list[int]  # T: the request's ``tokens``
    directives: list[Directive]  # compiled, in request order (a miss names directives[i])
    order: list[Directive]  # the same, right to left: the execution order
    new_tokens: list[int]  # T'

    @property
    def needs_lookup(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class MessageForm:
    """A message-form request compiled: both conversations rendered and diffed."""

    base: list[int]  # T: the rendered old messages
    spans: list[Span]  # where T' differs from T, left to right
    new_tokens: list[int]  # T': the rendered new messages

    @property
    def needs_lookup(self) -> bool:
        """False when nothing changed: the answer is a noop whatever is cached."""
        return bool(self.spans)


Compiled = TokenForm | MessageForm


@dataclass(frozen=True, slots=True)
class Plan:
    """What a backend executes: ``order`` (right to left, at least one directive, every
    span inside ``base``) on ``base = T[:cached]``; ``new_tokens`` is the answer's ``T'``."""

    base: list[int]
    order: list[Directive]
    new_tokens: list[int]
    cached: int


Decision = Plan | DirectivesResponse  # a plan to execute, or the answer (noop / fallback)


def compile_request(
    req: DirectivesRequest,
    tokenizer: Any,
    vocab_size: int,
    message_boundary_id: int | None,
    executes: Iterable[Mode] = ALL_MODES,
) -> Compiled:
    """``req`` compiled for its form (module doc, step 1); no cache is asked anything.
    ``InvalidRequestError`` / ``DirectiveError`` / ``TrajectoryError`` name the bad field;
    a mode outside ``executes`` (the backend's) is ``UnsupportedModeError`` naming it."""
    if req.directives is not None:
        check_modes(((f"directives[{i}].mode", d.mode) for i, d in enumerate(req.directives)),
                    executes)  # fmt: skip
    else:
        check_modes([("mode", req.mode)], executes)
    if req.tokens is not None and req.directives is not None:
        tokens, compiled = token_form(req.tokens, req.directives, tokenizer, vocab_size)
        order = plan_batch(compiled, seq_len=len(tokens))
        return TokenForm(tokens, compiled, order, splice_tokens(tokens, order))
    edits = message_edits(
        tokenizer,
        list(req.old_messages or []),
        list(req.new_messages or []),
        req.tools,
        message_boundary_id,
    )
    return MessageForm(edits.old, edits.spans, edits.new)


def decide(compiled: Compiled, cached: int, req: DirectivesRequest) -> Decision:
    """The miss, noop or plan for ``compiled`` when the first ``cached`` tokens of its base
    are cached (module doc, step 2); ``cached`` is clamped to ``[0, len(base)]``."""
    cached = max(0, min(cached, len(compiled.base)))
    if isinstance(compiled, TokenForm):
        for i, d in enumerate(compiled.directives):
            if d.end > cached or cached == 0:
                return _miss(compiled, req, _token_miss(i, d, cached, len(compiled.base)))
        if not compiled.order:
            return noop_answer(compiled.new_tokens, cached, reused=cached)
        return Plan(compiled.base[:cached], compiled.order, compiled.new_tokens, cached)
    spans = compiled.spans
    if not spans:
        return noop_answer(compiled.new_tokens, 0, reused=len(compiled.base))
    kept = clip_to_cached(spans, cached)
    if cached == 0 or not kept or (kept != spans and not req.fallback):
        return _miss(compiled, req, _message_miss(spans, cached))
    order = plan_batch(to_directives(kept, req.mode, req.budget), seq_len=cached)
    return Plan(compiled.base[:cached], order, compiled.new_tokens, cached)


def _token_miss(i: int, d: Directive, cached: int, n: int) -> str:
    return (
        f"directives[{i}]: span [{d.start}, {d.end}) of 'tokens' is not cached "
        f"(the prefix cache holds its first {cached} of {n} tokens)"
    )


def _message_miss(spans: list[Span], cached: int) -> str:
    return (
        f"old_messages: the edits span tokens [{spans[0].start}, {spans[-1].end}) of the "
        f"rendered conversation but only its first {cached} tokens are cached "
        "(without fallback no edit is applied in part)"
    )


def _miss(compiled: Compiled, req: DirectivesRequest, message: str) -> DirectivesResponse:
    if not req.fallback:
        raise CacheMissError(message)
    return fallback_answer(compiled)


def fallback_answer(compiled: Compiled) -> DirectivesResponse:
    """Nothing executed: ``T'`` as the request wants it, for the next request to prefill.
    A token-form answer lists the directives it would have run; a message-form one none
    (which of its spans would have been kept depends on a cache that did not hold them)."""
    applied = compiled.order if isinstance(compiled, TokenForm) else []
    return DirectivesResponse(
        outcome="fallback", tokens=compiled.new_tokens, applied=applied, fallback=True
    )


def noop_answer(new_tokens: list[int], cached: int, *, reused: int) -> DirectivesResponse:
    """Nothing to change: no splice, ``reused`` rows of the base kept as they are."""
    return DirectivesResponse(
        outcome="noop",
        cached_base_tokens=cached,
        tokens=new_tokens,
        applied=[],
        splices={"amortize": 0, "forget": 0},
        reused_tokens=reused,
    )


def applied_answer(
    plan: Plan,
    *,
    splices: Mapping[str, int],
    reused: int,
    prefilled: int,
    rotated: int,
    repaired: int = 0,
) -> DirectivesResponse:
    """The answer to an executed ``plan``, with the backend's counts of what it did."""
    return DirectivesResponse(
        outcome="applied",
        cached_base_tokens=plan.cached,
        tokens=plan.new_tokens,
        applied=plan.order,
        splices=dict(splices),
        reused_tokens=reused,
        prefilled_tokens=prefilled,
        rotated_tokens=rotated,
        repaired_tokens=repaired,
    )
