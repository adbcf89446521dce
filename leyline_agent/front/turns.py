"""One chat turn of a tracked conversation: plan (pure), then execute on the worker.

``plan_turn`` takes the request's messages (normalized), the conversation it continues (or
none), the checked ``context_management`` edits and the splice mode, and returns:

- ``served``: the prompt to serve. Messages the client left as they were keep what the
  server served for them last time (edits are sticky); messages the client edited in place
  are the client's; then the server's policies run on the result (idempotent on stubs).
- up to two message-form directives, in order: the client's own edits (cached prompt ->
  prompt with the client's edits), then the policies' (-> ``served``). Both use the turn's
  mode (``amortize`` / ``forget``; always ``forget`` in a conversation marked exact by a
  FORGET of its session); with ``off`` there are none and the next prefill is exact.
- for a conversation found by its echo alone (``Match.drift``: earlier messages changed in
  ways that are not in-place edits), the messages as sent and no message-form directive:
  the token diff of ``chat_turn.drift_turn`` splices whatever differs, policy edits included.
- ``labels``: which ``context_management`` edit stubbed each served message (for
  ``applied_edits``, counted over the whole prompt, as Anthropic reports them).

The policies run within ``budget_s`` (``POLICY_BUDGET_S``): past it the turn is refused with a
``RequestError`` naming the edit that ran over (``context_management.edits[k]``), before any
directive is planned, so nothing is spliced.

``execute_turn`` (on the worker thread) runs the directives in the conversation's
namespace with ``fallback`` (a base the cache no longer holds is a counted fallback, never
a failure) and returns what each did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from leyline_agent.directives import Mode
from leyline_agent.directives.drift_plan import DriftCounts
from leyline_agent.directives.modes import turn_mode
from leyline_agent.errors import RequestError
from leyline_agent.front.context_management import EditSpec
from leyline_agent.front.conversations import Conversation, Match
from leyline_agent.namespaces import Namespace
from leyline_agent.policies import PolicyPipeline
from leyline_agent.policies.pipeline import PolicyBudgetError
from leyline_agent.trajectory import message_text
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

__all__ = [
    "TurnEngine",
    "TurnPlan",
    "TurnResult",
    "applied_edits",
    "execute_turn",
    "plan_turn",
    "splice_mode_of",
]


class TurnEngine(Protocol):
    """What a chat turn's job asks of the engine it runs on (``leyline serve``'s
    ``ServedEngine``; the vLLM chat front's bridge to its directive route)."""

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...

    def apply_directives(
        self, request: DirectivesRequest, *, namespace: Namespace | None = None
    ) -> DirectivesResponse: ...

    def counters(self, tenant: str) -> DriftCounts: ...


@dataclass(slots=True)
class TurnPlan:
    served: list[dict[str, Any]]
    labels: dict[int, str]
    client_edited: list[int]
    policy_edited: list[int]
    directives: list[tuple[str, DirectivesRequest]] = field(default_factory=list)


@dataclass(slots=True)
class TurnResult:
    kind: str  # "client_edits" or "context_management"
    response: DirectivesResponse | None
    error: str | None = None


def _tool_uses(messages: Sequence[dict[str, Any]]) -> int:
    return sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))


POLICY_BUDGET_S = 2.0  # a turn's context_management policies, all together


def plan_turn(
    messages: list[dict[str, Any]],
    match: Match | None,
    specs: Sequence[EditSpec],
    mode: str,
    prompt_tokens: Callable[[list[dict[str, Any]]], int],
    tools: list[dict[str, Any]] | None,
    budget_s: float = POLICY_BUDGET_S,
    repair_budget: float | None = None,
) -> TurnPlan:
    """The turn's served messages and directives. ``repair_budget``: the REPAIR budget of
    the client edits (none: the server's); the policies' edits splice in the most exact mode
    they ask for (their ``mode`` knob, ``modes.turn_mode``), else the turn's."""
    deadline = time.monotonic() + budget_s
    conv = match.conversation if match is not None else None
    base = [dict(m) for m in messages]
    labels: dict[int, str] = {}
    edited = list(match.edited) if match is not None else []
    if conv is not None and match is not None and not match.drift:  # drift: served as sent
        for i in range(min(len(conv.raw), len(base))):
            if i not in edited:
                base[i] = dict(conv.served[i])
                if i in conv.labels:
                    labels[i] = conv.labels[i]
    triggered = [
        (k, s)
        for k, s in enumerate(specs)
        if _tool_uses(base) >= s.trigger_tool_uses
        and (not s.trigger_tokens or prompt_tokens(base) > s.trigger_tokens)
    ]
    served = base
    policy_edited: list[int] = []
    if triggered:
        try:
            result = PolicyPipeline([s.policy for _, s in triggered]).apply(base, deadline=deadline)
        except PolicyBudgetError as e:
            k = triggered[e.policy_index][0]
            raise RequestError(
                f"the edits took longer than their {budget_s:g} s budget (this one ran over it)",
                f"context_management.edits[{k}]",
            ) from e
        served = result.messages
        names = {s.policy.name: str(k) for k, s in reversed(triggered)}
        for e in result.edits:
            labels[e.index] = names.get(e.policy.split("+")[0], str(triggered[0][0]))
            policy_edited.append(e.index)
    plan = TurnPlan(served, labels, edited, policy_edited)
    if conv is None or match is None or match.retry or match.drift or mode == "off":
        return plan  # a drift match is spliced by the token diff (``drift_turn``)
    n = len(conv.raw) + 1  # the cached prompt and the reply
    splice_mode = splice_mode_of(mode, conv)
    assert splice_mode is not None  # "off" returned above
    cached = [*conv.served, messages[len(conv.raw)]]
    asked = [(e.mode, e.budget) for e in result.edits] if triggered else []
    policy_mode = turn_mode(asked, splice_mode) if asked else (splice_mode, repair_budget)
    if conv.exact:
        policy_mode = (Mode.FORGET, None)
    client_budget = repair_budget if splice_mode is Mode.REPAIR else None
    steps = [
        ("client_edits", cached, base[:n], (splice_mode, client_budget)),
        ("context_management", base[:n], served[:n], policy_mode),
    ]
    for kind, old, new, (m, b) in steps:
        if old != new:
            req = DirectivesRequest(
                old_messages=old,
                new_messages=new,
                tools=tools,
                mode=m,
                budget=b if m is Mode.REPAIR else None,
                fallback=True,
            )
            plan.directives.append((kind, req))
    return plan


def execute_turn(engine: TurnEngine, plan: TurnPlan, ns: Namespace) -> list[TurnResult]:
    """Run the plan's directives in order (worker thread). A directive that fails changed
    nothing (the engine's guarantee): the rest are skipped and the turn is served exactly."""
    out = []
    for kind, req in plan.directives:
        try:
            out.append(TurnResult(kind, engine.apply_directives(req, namespace=ns)))
        except Exception as exc:  # the cache is unchanged; serve the prompt exactly
            out.append(TurnResult(kind, None, f"{type(exc).__name__}: {exc}"))
            break
    return out


def applied_edits(
    specs: Sequence[EditSpec],
    raw: Sequence[dict[str, Any]],
    plan: TurnPlan,
    count: Callable[[str], int],
) -> list[dict[str, Any]]:
    """Anthropic's ``applied_edits``: per edit, the tool uses it has cleared in this prompt
    and the input tokens that saved (the tokenizer's count of the original text, arguments
    included, minus the stub's)."""
    out = []
    for k, spec in enumerate(specs):
        uses = tokens = 0
        for i, label in plan.labels.items():
            if label != str(k) or i >= len(raw):
                continue
            before, after = raw[i], plan.served[i]
            if before.get("role") == "tool":
                uses += 1
            tokens += max(0, count(message_text(before)) - count(message_text(after)))
            tokens += max(0, count(_args(before)) - count(_args(after)))
        if spec.type.startswith("clear_thinking"):  # Anthropic's fields for this edit
            cleared = sum(1 for i, label in plan.labels.items() if label == str(k))
            entry = {"type": spec.type, "cleared_thinking_turns": cleared}
            out.append({**entry, "cleared_input_tokens": tokens})
            continue
        out.append({"type": spec.type, "cleared_tool_uses": uses, "cleared_input_tokens": tokens})
    return out


def _args(m: dict[str, Any]) -> str:
    return "".join(c["function"].get("arguments") or "" for c in m.get("tool_calls") or [])


_SPLICE_MODES = {"amortize": Mode.AMORTIZE, "forget": Mode.FORGET, "repair": Mode.REPAIR}


def splice_mode_of(mode: str, conv: Conversation) -> Mode | None:
    """The mode a turn splices in: the front's ``client_edits`` mode (None for ``off``),
    FORGET in a conversation marked exact; an unknown mode raises."""
    if mode == "off":
        return None
    if mode not in _SPLICE_MODES:
        raise ValueError(f"client_edits: {mode!r} is not one of {[*_SPLICE_MODES, 'off']}")
    return Mode.FORGET if conv.exact else _SPLICE_MODES[mode]
