"""Server-side context editing of one chat request, on any engine: find, splice, answer.

Every Leyline front runs a tracked chat turn the same way; only the transport differs
(``leyline serve``: ``server/chat_context.py``; ``vllm serve``: ``front/chat_proxy.py``):

1. ``begin_turn`` (cheap, on the event loop): check ``leyline`` and ``context_management``,
   find the conversation the request continues (``conversations``), or start one. None when
   the turn's mode is ``off`` and it carries no ``context_management``: serve it as it is.
2. ``ChatTurn.run(engine)`` (the turn's engine job, one at a time per conversation): plan
   the turn (``turns.plan_turn``: sticky edits, the client's own in-place edits, the
   server's policies), execute its directives in the conversation's namespace
   (``turns.execute_turn``, with ``fallback``), and, when the plan has no message-form
   directive, diff the served prompt's tokens against the ones the conversation's last
   answer left in the cache (``Conversation.tokens``) and splice the drift
   (``directives.drift_plan``): a template that strips earlier thinking, or a changed head
   line, becomes a splice instead of a re-prefill. Drift is believed only from a request
   that proved it holds the reply (``Match.echoed``).
3. ``ChatTurn.prepared(outcome)``: the messages to serve, the namespace to serve them in,
   the answer's top-level fields (``leyline``; ``context_management.applied_edits``), its
   ``usage.leyline``, and ``commit(reply, tokens)``, called once the answer is complete
   (never for an abandoned one) to record the conversation for its next turn. ``tokens``:
   what the answer left in the cache (prompt and output ids, or the prompt alone); without
   them the next turn is not diffed.

Mode: the front's default (``leyline serve --client-edits``, ``LEYLINE_CLIENT_EDITS`` on
vLLM), overridden per request by ``{"leyline": {"client_edits": ...}}``; it governs drift
splices too. A conversation marked exact (a FORGET ran in its session) splices by FORGET.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from leyline_agent.chat_input import canonical_message, canonical_messages
from leyline_agent.directives import Mode
from leyline_agent.directives.drift_plan import DriftOutcome, plan_drift
from leyline_agent.directives.modes import rule_of
from leyline_agent.errors import RequestError
from leyline_agent.front.context_management import (
    EditSpec,
    parse_context_management,
    parse_leyline_options,
)
from leyline_agent.front.conversations import Conversation, ConversationStore, Match
from leyline_agent.front.turns import (
    TurnEngine,
    TurnPlan,
    TurnResult,
    applied_edits,
    execute_turn,
    plan_turn,
    splice_mode_of,
)
from leyline_agent.logs import get_logger
from leyline_agent.namespaces import Namespace
from leyline_agent.wire import DirectivesResponse

__all__ = [
    "ChatTurn",
    "PreparedChat",
    "TurnOutcome",
    "begin_turn",
    "drift_turn",
    "splice_mode_of",
]

log = get_logger(__name__)


@dataclass(slots=True)
class PreparedChat:
    messages: list[dict[str, Any]]  # what to serve (canonical)
    namespace: Namespace  # where to serve it
    body: dict[str, Any]  # the answer's top-level fields
    usage: dict[str, Any]  # the answer's usage.leyline
    commit: Callable[..., None]  # (reply, tokens=None): the answer and its cached ids


@dataclass(slots=True)
class TurnOutcome:
    plan: TurnPlan
    edits: list[dict[str, Any]]  # context_management.applied_edits
    results: list[TurnResult]
    drift: DriftOutcome | None
    rendered: list[int] | None  # the served prompt's ids, where the job rendered them


@dataclass(slots=True)
class ChatTurn:
    """One tracked chat turn (module doc)."""

    store: ConversationStore
    tenant: str
    messages: list[dict[str, Any]]  # canonical, as the client sent them
    match: Match | None
    conversation: Conversation
    specs: list[EditSpec]
    mode: str
    tools: list[dict[str, Any]] | None
    count: Callable[[str], int]
    repair_budget: float | None = None  # the request's leyline.repair_budget

    @property
    def namespace(self) -> Namespace:
        """The conversation's namespace: where its splices run and its turns are served."""
        return Namespace(self.tenant, self.conversation.session)

    def run(self, engine: TurnEngine) -> TurnOutcome:
        """Plan, splice, diff (the turn's engine job)."""
        tools, match, ns = self.tools, self.match, self.namespace

        def prompt_tokens(ms: list[dict[str, Any]]) -> int:
            return len(engine.render(ms, tools=tools, add_generation_prompt=True))

        plan = plan_turn(
            self.messages,
            match,
            self.specs,
            self.mode,
            prompt_tokens,
            tools,
            repair_budget=self.repair_budget,
        )
        edits = applied_edits(self.specs, self.messages, plan, self.count) if self.specs else []
        results = execute_turn(engine, plan, ns)
        drift = rendered = None
        if match is not None and not match.retry and self.mode != "off" and not plan.directives:
            rendered = engine.render(plan.served, tools=tools, add_generation_prompt=True)
            mode = splice_mode_of(self.mode, self.conversation)
            assert mode is not None  # not "off"
            drift = drift_turn(engine, match, rendered, mode, ns)
        return TurnOutcome(plan, edits, results, drift, rendered)

    def prepared(self, out: TurnOutcome) -> PreparedChat:
        """What the transport serves and answers (module doc)."""
        conv, plan, mode = self.conversation, out.plan, splice_mode_of(self.mode, self.conversation)
        splices: dict[str, int] = {"amortize": 0, "forget": 0}
        rotated = repaired = 0
        done = []
        for r in out.results:
            entry: dict[str, Any] = {"kind": r.kind}
            if r.response is not None:
                entry.update(
                    outcome=r.response.outcome,
                    splices=r.response.splices,
                    prefilled_tokens=r.response.prefilled_tokens,
                    rotated_tokens=r.response.rotated_tokens,
                    repaired_tokens=r.response.repaired_tokens,
                )
                for k, v in r.response.splices.items():
                    splices[k] = splices.get(k, 0) + v
                rotated += r.response.rotated_tokens
                repaired += r.response.repaired_tokens
            else:
                entry.update(outcome="error", error=r.error)
            done.append(entry)
        leyline: dict[str, Any] = {
            "conversation": conv.id,
            "session": None if conv.anonymous else conv.session,  # the server's own: never shown
            "client_edits": self.mode,
            "edited_messages": plan.client_edited,
            "policy_edited_messages": plan.policy_edited,
            "directives": done,
        }
        body: dict[str, Any] = {"leyline": leyline}
        if self.specs:
            body["context_management"] = {"applied_edits": out.edits}
        usage = {
            "splices": splices,
            "rotated_tokens": rotated,
            "repaired_tokens": repaired,
            "client_edited_messages": len(plan.client_edited),
        }
        drift = out.drift
        if drift is not None:
            leyline["drift"] = usage["drift"] = drift.wire()
            if drift.spliced:
                splices[str(mode)] = splices.get(str(mode), 0) + 1
                usage["rotated_tokens"] = rotated + drift.rotated_tokens
        spliced = (
            conv.spliced
            or any(r.response and _moved_tail(r.response) for r in out.results)
            or bool(drift and drift.spliced and mode and rule_of(mode).moves_tail)
        )
        store, tenant, messages = self.store, self.tenant, self.messages

        def commit(reply: dict[str, Any], tokens: Sequence[int] | None = None) -> None:
            store.save(
                tenant,
                Conversation(
                    id=conv.id,
                    session=conv.session,
                    raw=messages,
                    served=plan.served,
                    reply=canonical_message(reply),
                    labels=plan.labels,
                    spliced=bool(spliced),
                    exact=conv.exact,
                    tokens=tuple(tokens) if tokens else None,
                    owner=conv.owner,
                ),
            )

        return PreparedChat(plan.served, self.namespace, body, usage, commit)


def begin_turn(
    store: ConversationStore,
    default_mode: str,
    raw_messages: list[dict[str, Any]],
    context_management: Any,
    leyline: Any,
    tools: list[dict[str, Any]] | None,
    ns: Namespace,
    count: Callable[[str], int],
    *,
    declared: frozenset[int] = frozenset(),
    owner: str = "",
) -> ChatTurn | None:
    """The tracked form of a chat request, or None (serve it as it is). ``leyline``: the
    request's options (``client_edits``); ``count``: the served tokenizer's count of a text
    (called from the turn's job only); ``declared``: indices the request says it edited in
    place (``directives.body_edits``); ``owner``: the request's API key (anonymous
    conversations are its own, ``conversations``). Bad fields raise ``RequestError`` naming
    them."""
    opts = parse_leyline_options(leyline)
    specs = parse_context_management(context_management, count)
    mode = opts.client_edits or default_mode
    if opts.repair_budget is not None and mode != "repair":
        raise RequestError(
            f"applies to client_edits 'repair' only, not {mode!r}", "leyline.repair_budget"
        )
    if mode == "off" and not specs:
        return None
    messages = canonical_messages(raw_messages)
    # an anonymous request claims the state it continues, so that clients with the same
    # opening that arrive together each get a conversation of their own
    match = store.find(
        ns.tenant, ns.session, messages, declared=declared, claim=ns.session is None, owner=owner
    )
    conv = match.conversation if match is not None else store.new(ns.tenant, ns.session, owner)
    return ChatTurn(
        store, ns.tenant, messages, match, conv, specs, mode, tools, count, opts.repair_budget
    )


def drift_turn(
    engine: TurnEngine, match: Match, new: list[int], mode: Mode, ns: Namespace
) -> DriftOutcome | None:
    """Diff ``new`` against the conversation's cached tokens and splice what drifted (the
    turn's job); None when the prompt continues them as they are. Every outcome is counted
    in the tenant's counters."""
    planned = plan_drift(match.conversation.tokens or (), new, mode)
    if planned is None:
        return None
    out, req = planned
    if req is not None and not match.echoed:
        out.refuse("unproven")  # the request did not show it holds the reply
    elif req is not None:
        try:
            out.settle(engine.apply_directives(req, namespace=ns))
        except Exception as exc:  # nothing changed (the engine's guarantee): prefill exactly
            log.warning("drift.error", error=f"{type(exc).__name__}: {exc}")
            out.refuse("error")
    out.count(engine.counters(ns.tenant))
    return out


def _moved_tail(resp: DirectivesResponse) -> bool:
    """Whether a directive's answer spliced a tail in place (its rows are no longer exact)."""
    return any(n and rule_of(m).moves_tail for m, n in resp.splices.items())
