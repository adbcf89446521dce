"""PolicyPipeline: composition order, determinism, idempotence, and bad edits from policies."""

from __future__ import annotations

import copy
from typing import ClassVar

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from leyline_agent.directives import MessageEdit
from leyline_agent.errors import PolicyError
from leyline_agent.policies import FailedCallDetector, Policy, StaleToolTruncation
from leyline_agent.policies.pipeline import PolicyPipeline
from leyline_agent.testing.trajectories import TrajectoryBuilder
from leyline_agent.trajectory import Trajectory


def old_and_recent_failures() -> TrajectoryBuilder:
    t = TrajectoryBuilder().user("u")
    t.tool_turn(("bash", {"c": 0}, "Error: old failure"))  # turn 0: stale and failed
    t.tool_turn(("bash", {"c": 1}, "fine " * 20))  # turn 1: stale
    t.tool_turn(("bash", {"c": 2}, "Error: recent failure"))  # turn 2: kept, failed, moved past
    t.tool_turn(("bash", {"c": 3}, "ok"))  # turn 3: kept
    return t


def test_composition_order_later_policy_sees_earlier_stubs_and_leaves_them():
    t = old_and_recent_failures()
    msgs = t.messages
    a0, a2 = t.call_index(0), t.call_index(2)
    (r0,), (r1,), (r2,) = t.result_indices(0), t.result_indices(1), t.result_indices(2)
    stale = "[stale output of bash elided]"

    res = PolicyPipeline([FailedCallDetector(), StaleToolTruncation(keep=2)]).apply(msgs)
    # a stub is final: failed-call stubbed r0 first, stale-tool (stale r0) leaves it alone
    assert res.messages[r0]["content"] == "[failed call elided] bash: Error: old failure"
    assert res.messages[a0]["tool_calls"][0]["function"]["arguments"] == "{}"  # failed-call's
    assert res.messages[r1]["content"] == stale
    assert res.messages[r2]["content"] == "[failed call elided] bash: Error: recent failure"
    by_index = {e.index: e for e in res.edits}
    assert by_index[r0].policy == "failed-call"
    assert sorted(by_index) == sorted([a0, r0, r1, a2, r2])

    res = PolicyPipeline([StaleToolTruncation(keep=2), FailedCallDetector()]).apply(msgs)
    assert res.messages[r0]["content"] == stale  # failed-call sees the stub: no failure left
    assert res.messages[a0] == msgs[a0]
    assert res.messages[r2]["content"] == "[failed call elided] bash: Error: recent failure"
    assert {e.index for e in res.edits} == {r0, r1, a2, r2}


def test_net_edits_reproduce_the_output_from_the_input():
    t = old_and_recent_failures()
    msgs = t.messages
    res = PolicyPipeline(
        [FailedCallDetector(), StaleToolTruncation(keep=2, clear_inputs=True)]
    ).apply(msgs)
    rebuilt = copy.deepcopy(msgs)
    for e in res.edits:
        if e.content is not None:
            rebuilt[e.index]["content"] = e.content
        if e.tool_calls is not None:
            rebuilt[e.index]["tool_calls"] = e.tool_calls
    assert rebuilt == res.messages


# -- property: deterministic, idempotent, input untouched, never inserts/removes ------------

OUTPUTS = st.sampled_from(
    [
        "ok",
        "a.py b.py",
        "Error: nope",
        "Traceback (most recent call last):\nOSError: x",
        "x" * 300,
        "exit code 3",
        "3 passed",
    ]
)
TURN = st.lists(
    st.tuples(st.sampled_from(["bash", "view", "edit"]), OUTPUTS), min_size=1, max_size=3
)


@st.composite
def trajectories(draw):
    t = TrajectoryBuilder().user("task")
    for k, calls in enumerate(draw(st.lists(TURN, min_size=0, max_size=7))):
        t.tool_turn(*[(name, {"k": k, "j": j}, out) for j, (name, out) in enumerate(calls)])
        if draw(st.booleans()):
            t.user("continue")
    if draw(st.booleans()):
        t.text("done")
    return t.messages


POLICIES = st.lists(
    st.one_of(
        st.builds(
            StaleToolTruncation,
            keep=st.integers(1, 4),
            min_tokens=st.sampled_from([0, 5, 50]),
            clear_inputs=st.booleans(),
            clear_at_least=st.sampled_from([0, 60, 400]),
            trigger_tokens=st.sampled_from([0, 0, 150]),
            exclude_tools=st.sampled_from([(), ("view",)]),
        ),
        st.builds(FailedCallDetector, after=st.integers(1, 3), stub_arguments=st.booleans()),
    ),
    min_size=1,
    max_size=3,
)


def bash_turns(*outputs: str) -> list[dict]:
    t = TrajectoryBuilder().user("task")
    for k, out in enumerate(outputs):
        t.tool_turn(("bash", {"k": k}, out))
    return t.messages


# A stub that grows past min_tokens, as the property found it: stale-tool (min_tokens=5)
# leaves the small failed output at index 13 alone, failed-call replaces it by a longer stub,
# and a second run of stale-tool found that stub big enough to stub (an edit at index 13 on
# the second run).
STUB_GROWS_PAST_MIN_TOKENS = bash_turns(
    "x" * 300, "ok", "a.py b.py", "3 passed", "x" * 300, "exit code 3", "ok"
)
# The same cause read the other way: a stale stub of a failed call (index 5) counted as a
# success, so on a second run failed-call saw a recovery and stubbed the failure before it.
STALE_STUB_AS_SUCCESS = bash_turns(
    "Error: nope", "Traceback (most recent call last):\nOSError: x", "exit code 3"
)
# Leaving stubs out of clear_at_least's count must not raise it: a result shorter than its
# stub (index 3) counted negative savings, so without it the second run crossed 60.
NEGATIVE_SAVINGS = bash_turns("Error: nope", "x" * 272, "ok")


@settings(max_examples=120, deadline=None)
@given(msgs=trajectories(), policies=POLICIES)
@example(
    msgs=STUB_GROWS_PAST_MIN_TOKENS, policies=[StaleToolTruncation(keep=1, min_tokens=5), FailedCallDetector(after=1)]
)
@example(
    msgs=STALE_STUB_AS_SUCCESS,
    policies=[FailedCallDetector(after=3), StaleToolTruncation(keep=1, min_tokens=5)],
)
@example(
    msgs=NEGATIVE_SAVINGS,
    policies=[StaleToolTruncation(keep=1, clear_at_least=60), FailedCallDetector(after=1)],
)
def test_engine_is_deterministic_idempotent_and_pure(msgs, policies):
    before = copy.deepcopy(msgs)
    engine = PolicyPipeline(policies)
    res = engine.apply(msgs)
    assert msgs == before
    assert len(res.messages) == len(msgs)
    assert [m["role"] for m in res.messages] == [m["role"] for m in msgs]
    Trajectory.parse(res.messages)  # still well formed, pairing intact
    assert PolicyPipeline(policies).apply(copy.deepcopy(msgs)) == res  # deterministic
    again = engine.apply(res.messages)
    assert again.edits == [] and again.messages == res.messages  # idempotent
    changed = [i for i, (a, b) in enumerate(zip(msgs, res.messages, strict=True)) if a != b]
    assert [e.index for e in res.edits] == changed


# -- bad edits from a (custom) policy -------------------------------------------------------


class Returns(Policy):
    name: ClassVar[str] = "returns"

    def __init__(self, edits):
        self._edits = edits

    def edits(self, trajectory):
        return self._edits


@pytest.mark.parametrize(
    "edit,needle",
    [
        (MessageEdit(index=99, content="x", policy="returns"), r"\.index: 99"),
        (
            MessageEdit(index=2, tool_calls=[], policy="returns"),
            r"\.tool_calls: messages\[2\] is a tool",
        ),
        (
            MessageEdit(index=1, tool_calls=[{"id": "other"}], policy="returns"),
            r"call ids \['other'\]",
        ),
        (MessageEdit(index=2, content="", policy="returns"), r"\.content: a tool result"),
        ({"index": 2, "content": "x"}, r"expected a MessageEdit"),
    ],
)
def test_bad_edits_raise_naming_the_policy_and_nothing_is_returned(edit, needle):
    t = TrajectoryBuilder(system=None).user("u").tool_turn(("bash", {}, "out"))
    msgs = t.messages
    before = copy.deepcopy(msgs)
    with pytest.raises(PolicyError, match=r"policy 'returns' edits\[0\].*" + needle):
        PolicyPipeline([StaleToolTruncation(keep=1), Returns([edit])]).apply(msgs)
    assert msgs == before


def test_engine_rejects_things_that_are_not_policies():
    with pytest.raises(PolicyError, match=r"policies\[1\]"):
        PolicyPipeline([StaleToolTruncation(), "failed-call"])
    with pytest.raises(PolicyError, match="policies"):
        PolicyPipeline("stale-tool")


def test_a_policy_cannot_modify_the_callers_messages():
    class Vandal(Policy):
        name: ClassVar[str] = "vandal"

        def edits(self, trajectory):
            trajectory.messages[0]["content"] = "vandalised"
            return []

    msgs = TrajectoryBuilder().user("u").messages
    res = PolicyPipeline([Vandal()]).apply(msgs)
    assert msgs[0]["content"] != "vandalised"
    assert res.edits == []


def test_a_stub_is_final_for_every_policy_of_the_pipeline():
    class Redact(Policy):  # a custom policy that declares its stub
        name: ClassVar[str] = "redact"

        def edits(self, trajectory):
            return [
                MessageEdit(index=i, content="[redacted]", policy=self.name)
                for i in trajectory.result_of
                if "secret" in trajectory.text(i)
            ]

        def is_stub(self, text, tool):
            return text == "[redacted]"

    t = TrajectoryBuilder().user("u")
    t.tool_turn(("bash", {}, "secret " * 40)).tool_turn(("bash", {}, "ok"))
    (r0,) = t.result_indices(0)
    rewrite = Returns([MessageEdit(index=r0, content="rewritten", policy="returns")])
    engine = PolicyPipeline([Redact(), StaleToolTruncation(keep=1), rewrite])
    res = engine.apply(t.messages)
    # r0 is stale and big, but stale-tool leaves the redaction alone, and the engine drops
    # the rewrite of a stubbed result
    assert res.messages[r0]["content"] == "[redacted]"
    assert [(e.index, e.policy) for e in res.edits] == [(r0, "redact")]
    assert engine.apply(res.messages).edits == []


def test_policy_engine_is_a_deprecated_alias_of_policy_pipeline():
    import leyline_agent

    with pytest.warns(DeprecationWarning, match="PolicyPipeline"):
        old = leyline_agent.PolicyEngine
    with pytest.warns(DeprecationWarning, match="PipelineResult"):
        from leyline_agent import EngineResult
    assert old is PolicyPipeline and EngineResult is leyline_agent.PipelineResult
