"""Pure: from a ``directives.pipeline.Plan`` to the SGLang calls that execute it.

The request was compiled and decided by ``directives.pipeline`` (``executor``); the plan's
directives run right to left, each on the sequence the previous one left:

- AMORTIZE ``(s, e, R)`` on ``T``: (0) ``collective_rpc("leyline_check")``, read-only: is
  ``T`` still cached through ``e``? (the lookup said so, but nothing holds the rows between
  two calls; a refused directive changes nothing, not even the tree);
  (1) a normal SGLang request for ``T[:s] + R`` with one new token: SGLang's own prefill
  (radix hit on ``T[:s]``, chunked prefill, every TP rank) computes R's KV over the prefix
  and caches it; (2) ``collective_rpc("leyline_splice")`` moves the cached tail ``T[e:]``
  behind it (``splice.py``).
- FORGET: (0) ``collective_rpc("leyline_forget")`` drops the session's cached rows of ``T'``
  from ``s`` on (``forget.py``: they may be a coinciding AMORTIZE's); (1) one normal
  request for ``T'``: prefix hit on ``T[:s]``, ``R + T[e:]`` prefilled afresh.

Every call names the session's namespace (``routing.py``): the RPCs carry it as
``namespace``, the requests as their ``extra_key``; the scheduler routes each request to the
session's tree or to the plain tree of exact rows.

Why a normal request for R rather than the scheduler's internal prefill: it is SGLang's
exact path (attention backend, CUDA graphs, chunking, TP/DP placement, accounting), needs
no private scheduler state, and what it caches is an ordinary tree path that the splice
then locks. The cost is one sampled token per directive, and a window between the two
calls in which LRU could evict the head: the splice then fails with ``CacheMissError``
and nothing is changed (retry, or fall back to FORGET).

No torch here: ``executor`` runs it for the HTTP route and the embedded-engine client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from leyline_agent.directives import Directive, plan_batch
from leyline_agent.directives.modes import executed_by, rule_of
from leyline_agent.directives.pipeline import Plan, applied_answer
from leyline_agent.directives.splice_plan import SpliceStep, splice_counts, tail_op
from leyline_agent.errors import DirectiveError
from leyline_agent.namespaces import ANONYMOUS
from leyline_agent.wire import DirectivesResponse

__all__ = [
    "EXECUTES",
    "PREFILL_PARAMS",
    "ROW_OPS",
    "DirectiveCalls",
    "plan_calls",
    "response_for",
]

# The row operations SGLang's scheduler hook implements, and so the modes it executes
# (``directives.modes``): REPAIR needs "recompute" and is refused by name.
ROW_OPS = frozenset({"move", "prefill"})
EXECUTES = executed_by(ROW_OPS)

# one greedy token: the prompt's KV is computed and cached when the request finishes
PREFILL_PARAMS = {"max_new_tokens": 1, "temperature": 0.0}


@dataclass(slots=True, frozen=True)
class DirectiveCalls:
    directive: Directive
    step: SpliceStep  # the planner's step on the sequence before it: what it moves and fills
    prefill_ids: list[int]  # AMORTIZE: T[:s] + R; FORGET: all of T'
    rpc_kwargs: dict[str, str | int]  # the RPCs' keywords (both modes)
    rpc_before: str  # before the prefill: leyline_check (read-only) / leyline_forget
    rpc_after: str | None  # after it: leyline_splice (AMORTIZE) / nothing (FORGET)


def plan_calls(
    tokens: Sequence[int], directives: Sequence[Directive], namespace: str = ANONYMOUS.key
) -> list[DirectiveCalls]:
    from leyline_agent.sglang_plugin.scheduler_hook import (
        RPC_CHECK,
        RPC_FORGET,
        RPC_METHOD,
        encode_splice_kwargs,
    )

    cur = [int(t) for t in tokens]
    steps = []
    for i, d in enumerate(plan_batch(list(directives), seq_len=len(cur))):
        if not isinstance(d.replacement, list):
            raise DirectiveError(f"directives[{i}].replacement: compile text to token ids first")
        after = cur[: d.start] + d.replacement + cur[d.end :]
        kw = encode_splice_kwargs(cur, d, namespace)
        rule_of(d.mode, executed_by(ROW_OPS), where=f"directives[{i}].mode")
        step = SpliceStep(d.start, d.end, tuple(d.replacement), d.mode, len(cur))
        if tail_op(d.mode) == "move":
            head = cur[: d.start] + d.replacement
            steps.append(DirectiveCalls(d, step, head, kw, RPC_CHECK, RPC_METHOD))
        else:  # "prefill" (``tail_op`` refuses any other tail)
            steps.append(DirectiveCalls(d, step, after, kw, RPC_FORGET, None))
        cur = after
    return steps


def response_for(steps: Sequence[DirectiveCalls], plan: Plan) -> DirectivesResponse:
    """The answer to an executed ``plan``; counts are what the steps asked for (each
    scheduler rank logs what it did)."""
    return applied_answer(
        plan,
        splices=splice_counts(st.step for st in steps),
        reused=sum(st.step.start for st in steps),
        prefilled=sum(st.step.filled_rows for st in steps),
        rotated=sum(st.step.moved_rows for st in steps),
    )
