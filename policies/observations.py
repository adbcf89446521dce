"""Tool results sent as user messages: smolagents' "Observation: ..." (opt-in per policy).

smolagents (and ReAct-style loops generally) do not use the ``tool`` role: the assistant
writes its action as text, and the result comes back as a ``user`` message whose text opens
with ``Observation:``. With a policy's ``observation_prefix`` knob set (e.g.
``"Observation:"``), ``observation_view`` reads such a message as the result of a
synthetic call made by the assistant message before it (name ``observation``, no
arguments, ``position == -1``: there is no ``tool_calls`` entry to edit), so the policy's
rules apply to it as to any tool result:

- a user message counts only if it comes right after an assistant message without real
  tool calls, and its text (after leading whitespace) starts with the prefix;
- ``text(i)`` of such a message is the observation without the prefix, so failure
  patterns and stub checks read the result itself; ``result_content(view, i, stub)``
  puts the prefix back in front of a stub, so the message still reads as an observation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

from leyline_agent.trajectory import ToolCall, ToolTurn, Trajectory

from .view import PipelineView, StubRecognizer

__all__ = ["OBSERVATION_TOOL", "ObservationView", "observation_view", "result_content"]

OBSERVATION_TOOL = "observation"


@dataclass(frozen=True, slots=True)
class ObservationView(PipelineView):
    """A ``PipelineView`` where ``observations`` (user messages) are tool results."""

    prefix: str = "Observation:"
    observations: frozenset[int] = frozenset()

    def text(self, index: int) -> str:
        text = Trajectory.text(self, index)
        if index in self.observations:
            return text.lstrip()[len(self.prefix) :].lstrip()
        return text


def result_content(trajectory: Trajectory, index: int, text: str) -> str:
    """The content to write for result ``index``: ``text``, behind the prefix if the
    result is an observation."""
    if isinstance(trajectory, ObservationView) and index in trajectory.observations:
        return f"{trajectory.prefix} {text}"
    return text


def observation_view(
    trajectory: Trajectory, prefix: str | None, policies: Iterable[StubRecognizer] = ()
) -> Trajectory:
    """``trajectory`` with its observation messages paired as tool results (``prefix``
    None or empty: ``trajectory`` itself). ``policies``: whose stubs count as elided (the
    pipeline's, when ``trajectory`` is a ``PipelineView`` that names them)."""
    if not prefix or isinstance(trajectory, ObservationView):
        return trajectory
    msgs = trajectory.messages
    found: dict[int, list[int]] = {}  # assistant index -> its observation message
    for i, m in enumerate(msgs):
        if (
            i > 0
            and m["role"] == "user"
            and msgs[i - 1]["role"] == "assistant"
            and not msgs[i - 1].get("tool_calls")
            and Trajectory.text(trajectory, i).lstrip().startswith(prefix)
        ):
            found[i - 1] = [i]
    if not found:
        return trajectory
    calls = dict(trajectory.calls)
    result_of = dict(trajectory.result_of)
    turns = list(trajectory.tool_turns)
    for a, results in found.items():
        made = []
        for i in results:
            call = ToolCall(
                f"observation@{i}", OBSERVATION_TOOL, "", a, -1, trajectory.turn_of[a], i
            )
            calls[call.id] = result_of[i] = call
            made.append(call)
        turns.append(ToolTurn(trajectory.turn_of[a], a, tuple(made)))
    turns.sort(key=lambda t: t.turn)
    base = {f.name: getattr(trajectory, f.name) for f in fields(Trajectory)}
    base.update(tool_turns=tuple(turns), calls=calls, result_of=result_of)
    observations = frozenset(i for rs in found.values() for i in rs)
    pipeline = tuple(getattr(trajectory, "policies", ())) or tuple(policies)
    view = ObservationView(**base, prefix=prefix, observations=observations, policies=pipeline)
    elided = frozenset(
        index
        for index, call in view.result_of.items()
        if any(p.is_stub(view.text(index), call.name) for p in pipeline)
    )
    return ObservationView(
        **base, elided=elided, prefix=prefix, observations=observations, policies=pipeline
    )
