"""``PolicyPipeline``: run policies in order over a message list; pure and idempotent.

``apply(messages)`` validates the list (``Trajectory.parse``), then gives each policy the
trajectory with the previous policies' edits applied (a ``PipelineView``: it also names the
tool results that are already a stub of some policy of the pipeline), checks every edit it
returns (index in range, tool calls only on assistant messages with the same call ids, so
tool results stay paired), drops edits that change nothing and content edits of results
already stubbed (a stub is final: the first policy to stub a result decides its text), and
returns the edited copy plus the net edits (one per changed message, relative to the
input). The input is never modified; a bad edit raises ``PolicyError`` before anything is
returned.

``deadline`` (a ``time.monotonic()`` value): checked after each policy; past it, the run stops
with ``PolicyBudgetError`` naming the policy that ran over (``policy_index``), and nothing is
returned (a server gives each request's policies a time budget).

Determinism: the output depends only on the message list and the policies' knobs.
Idempotence: ``apply(apply(m).messages)`` returns the same messages and no edits, as long
as every policy leaves stubs alone and reads them as no evidence (the built-in ones do;
see ``policies/base``).
Stickiness across turns is the session's job (``ContextSession``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from leyline_agent.directives import MessageEdit, Mode
from leyline_agent.directives.modes import turn_mode
from leyline_agent.errors import PolicyError
from leyline_agent.logs import get_logger
from leyline_agent.trajectory import Trajectory, apply_edit

from .base import Policy
from .view import PipelineView

__all__ = ["PipelineResult", "PolicyBudgetError", "PolicyPipeline"]

log = get_logger(__name__)  # silent until configured (leyline_agent.logs)


class PolicyBudgetError(PolicyError):
    """The pipeline ran past its deadline; ``policy_index``: the policy that ran over."""

    def __init__(self, message: str, policy_index: int) -> None:
        super().__init__(message)
        self.policy_index = policy_index


@dataclass(slots=True)
class PipelineResult:
    messages: list[dict[str, Any]]
    edits: list[MessageEdit] = field(default_factory=list)


class PolicyPipeline:
    def __init__(self, policies: Sequence[Any]) -> None:
        if isinstance(policies, (str, bytes)) or not isinstance(policies, Sequence):
            raise PolicyError(
                f"policies: expected a list of Policy objects, got {type(policies).__name__}"
            )
        for k, p in enumerate(policies):
            if not isinstance(p, Policy):
                raise PolicyError(
                    f"policies[{k}]: {p!r} is not a Policy (use leyline_agent.policies.load_policy "
                    "to build one from a name)"
                )
        self.policies = tuple(policies)

    def apply(
        self, messages: Sequence[dict[str, Any]], *, deadline: float | None = None
    ) -> PipelineResult:
        trajectory = Trajectory.parse(messages)
        original = trajectory.messages
        current = [dict(m) for m in original]
        touched: dict[int, list[str]] = {}
        reasons: dict[int, list[str]] = {}
        asked: dict[int, list[tuple[Mode, float | None]]] = {}  # index -> the modes asked
        for position, policy in enumerate(self.policies):
            view = PipelineView.of(
                trajectory if not touched else Trajectory.parse(current), self.policies
            )
            for k, edit in enumerate(policy.edits(view)):
                self._check(policy.name, k, edit, view)
                if edit.content is not None and edit.index in view.elided:
                    continue  # a stub is final
                new = apply_edit(current[edit.index], edit)
                if new == current[edit.index]:
                    continue
                current[edit.index] = new
                touched.setdefault(edit.index, []).append(edit.policy)
                if edit.mode is not None:
                    asked.setdefault(edit.index, []).append((edit.mode, edit.budget))
                if edit.reason:
                    reasons.setdefault(edit.index, []).append(edit.reason)
            if deadline is not None and time.monotonic() > deadline:
                raise PolicyBudgetError(
                    f"policy {policy.name!r} ran past the pipeline's deadline", position
                )
        edits = []
        for index in sorted(touched):
            before, after = original[index], current[index]
            content = (
                after.get("content") if after.get("content") != before.get("content") else None
            )
            calls = (
                after.get("tool_calls")
                if after.get("tool_calls") != before.get("tool_calls")
                else None
            )
            if content is None and calls is None:
                continue  # edited, then edited back
            names = list(dict.fromkeys(touched[index]))
            splice: dict[str, Any] = {}
            if index in asked:  # the most exact splice any of its policies asked for
                mode, budget = turn_mode(asked[index], Mode.AMORTIZE)
                splice = {"mode": mode, "budget": budget}
            edits.append(
                MessageEdit(
                    index=index,
                    content=content,
                    tool_calls=calls,
                    policy="+".join(names),
                    reason="; ".join(reasons.get(index, [])),
                    **splice,
                )
            )
        if edits:
            log.debug("policy_pipeline.edits", count=len(edits), indices=[e.index for e in edits])
        return PipelineResult(messages=[dict(m) for m in current], edits=edits)

    @staticmethod
    def _check(policy: str, k: int, edit: Any, view: Trajectory) -> None:
        where = f"policy {policy!r} edits[{k}]"
        if not isinstance(edit, MessageEdit):
            raise PolicyError(f"{where}: expected a MessageEdit, got {type(edit).__name__}")
        if edit.index >= len(view):
            raise PolicyError(f"{where}.index: {edit.index} is past the end ({len(view)} messages)")
        msg = view.messages[edit.index]
        if edit.content is not None and msg["role"] == "tool" and not edit.content:
            raise PolicyError(f"{where}.content: a tool result cannot be emptied entirely")
        if edit.tool_calls is not None:
            old = msg.get("tool_calls") or []
            if msg["role"] != "assistant" or not old:
                raise PolicyError(
                    f"{where}.tool_calls: messages[{edit.index}] is a {msg['role']} message without tool calls"
                )
            old_ids = [tc["id"] for tc in old]
            new_ids = [tc.get("id") if isinstance(tc, dict) else None for tc in edit.tool_calls]
            if new_ids != old_ids:
                raise PolicyError(
                    f"{where}.tool_calls: call ids {new_ids} must equal the message's {old_ids} "
                    "(tool results pair with them)"
                )
