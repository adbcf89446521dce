"""Server-side context editing of a chat request: find its conversation, splice, serve.

``prepare_chat`` runs before a chat request is rendered. Unless the turn's mode is ``off``
and it carries no ``context_management``, it finds the conversation the request continues
(``conversations``), plans the turn (``turns.plan_turn``: sticky edits, the client's own
in-place edits, the server's policies) and executes the plan's directives on the worker
in the conversation's namespace (``turns.execute_turn``). The route then renders and
generates ``PreparedChat.messages`` in ``PreparedChat.namespace``, adds ``body`` to its
answer and ``usage`` to ``usage.leyline``, and calls ``commit(reply)`` once the answer is
complete (never for an abandoned one), which records the conversation for its next turn.

Token drift: when the plan has no message-form directive, the same job renders the served
prompt and diffs it against the tokens the conversation's last answer cached
(``drift_turn``): a template that strips earlier thinking, or a changed head line, becomes
a splice instead of a re-prefill (``usage.leyline.drift``). ``commit(reply, tokens)`` takes
those tokens (the answer's prompt and output ids); without them the next turn is not diffed.

Mode: ``leyline serve --client-edits amortize|forget|off`` (``create_app(client_edits=)``),
overridden per request by ``{"leyline": {"client_edits": ...}}``; it governs drift splices too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from leyline_agent.chat_input import canonical_message
from leyline_agent.directives import Mode
from leyline_agent.namespaces import Namespace
from leyline_agent.server.completions import messages_for_template
from leyline_agent.server.context_management import (
    parse_context_management,
    parse_leyline_options,
)
from leyline_agent.server.conversations import Conversation
from leyline_agent.server.disconnect import run_connected
from leyline_agent.server.drift_turn import DriftOutcome, drift_turn
from leyline_agent.server.state import ServerState
from leyline_agent.server.turns import (
    TurnPlan,
    TurnResult,
    applied_edits,
    execute_turn,
    plan_turn,
)
from leyline_agent.server.worker import ServedEngine, session_key

__all__ = ["PreparedChat", "prepare_chat", "splice_mode_of"]


@dataclass(slots=True)
class PreparedChat:
    messages: list[dict[str, Any]]
    namespace: Namespace
    body: dict[str, Any]
    usage: dict[str, Any]
    commit: Callable[..., None]  # (reply, tokens=None): the answer and its cached ids


async def prepare_chat(
    request: Request,
    st: ServerState,
    raw_messages: list[dict[str, Any]],
    context_management: Any,
    leyline: Any,
    tools: list[dict[str, Any]] | None,
    ns: Namespace,
    *,
    declared: frozenset[int] = frozenset(),
) -> PreparedChat | None:
    """The conversation-tracked form of the request, or None (serve it as it is).
    ``declared``: indices the request says it edited in place (``request_edits``)."""
    opts = parse_leyline_options(leyline)
    tok = st.worker.engine.tokenizer  # called on the worker thread only (inside the job)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False)) if text else 0

    specs = parse_context_management(context_management, count)
    mode = opts.client_edits or st.client_edits
    if mode == "off" and not specs:
        return None
    messages = messages_for_template(raw_messages)  # canonical (chat_input)
    store = st.conversations
    # an anonymous request claims the state it continues, so that clients with the same
    # opening that arrive together each get a conversation of their own
    match = store.find(ns.tenant, ns.session, messages, declared=declared, claim=ns.session is None)
    conv = match.conversation if match is not None else store.new(ns.tenant, ns.session)
    conv_ns = Namespace(ns.tenant, conv.session)

    def job(
        engine: ServedEngine,
    ) -> tuple[TurnPlan, list[dict[str, Any]], list[TurnResult], DriftOutcome | None]:
        def prompt_tokens(ms: list[dict[str, Any]]) -> int:
            return len(engine.render(ms, tools=tools, add_generation_prompt=True))

        plan = plan_turn(messages, match, specs, mode, prompt_tokens, tools)
        edits = applied_edits(specs, messages, plan, count) if specs else []
        results = execute_turn(engine, plan, conv_ns)
        drift = None
        if match is not None and not match.retry and mode != "off" and not plan.directives:
            new = engine.render(plan.served, tools=tools, add_generation_prompt=True)
            drift = drift_turn(engine, match, new, splice_mode_of(mode, conv), conv_ns)
        return plan, edits, results, drift

    # one job per turn, in the conversation's session order: its directives never land in
    # the middle of another request of the same conversation
    plan, edits, results, drift = await run_connected(
        request, st.worker, job, key=session_key(conv_ns)
    )
    splices: dict[str, int] = {"amortize": 0, "forget": 0}
    rotated = 0
    done = []
    for r in results:
        entry: dict[str, Any] = {"kind": r.kind}
        if r.response is not None:
            entry.update(
                outcome=r.response.outcome,
                splices=r.response.splices,
                prefilled_tokens=r.response.prefilled_tokens,
                rotated_tokens=r.response.rotated_tokens,
            )
            for k, v in r.response.splices.items():
                splices[k] = splices.get(k, 0) + v
            rotated += r.response.rotated_tokens
        else:
            entry.update(outcome="error", error=r.error)
        done.append(entry)
    body: dict[str, Any] = {
        "leyline": {
            "conversation": conv.id,
            "session": conv.session,
            "client_edits": mode,
            "edited_messages": plan.client_edited,
            "policy_edited_messages": plan.policy_edited,
            "directives": done,
        }
    }
    if specs:
        body["context_management"] = {"applied_edits": edits}
    usage = {
        "splices": splices,
        "rotated_tokens": rotated,
        "client_edited_messages": len(plan.client_edited),
    }
    if drift is not None:
        body["leyline"]["drift"] = usage["drift"] = drift.wire()
        if drift.spliced:
            splices[str(splice_mode_of(mode, conv))] += 1
            usage["rotated_tokens"] = rotated + drift.rotated_tokens
    spliced = (
        conv.spliced
        or any(r.response and r.response.splices.get("amortize") for r in results)
        or bool(drift and drift.spliced and splice_mode_of(mode, conv) == Mode.AMORTIZE)
    )

    def commit(reply: dict[str, Any], tokens: Sequence[int] | None = None) -> None:
        store.save(
            ns.tenant,
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
            ),
        )

    return PreparedChat(plan.served, conv_ns, body, usage, commit)


def splice_mode_of(mode: str, conv: Conversation) -> Mode:
    """The mode a turn splices in: FORGET under ``forget`` or in a conversation marked exact."""
    return Mode.FORGET if mode == "forget" or conv.exact else Mode.AMORTIZE
