"""``observation_prefix``: user-role "Observation: ..." messages (smolagents' shape) as tool
results, honoured by both built-in policies; off by default."""

from __future__ import annotations

from leyline_agent.policies import FailedCallDetector, PolicyPipeline, StaleToolTruncation
from leyline_agent.policies.observations import observation_view
from leyline_agent.trajectory import Trajectory

BIG = "line of output\n" * 40


def _obs(text: str) -> dict:
    # smolagents sends tool responses as user messages with content parts
    return {"role": "user", "content": [{"type": "text", "text": f"Observation:\n{text}"}]}


def _say(text: str) -> dict:
    return {"role": "assistant", "content": text}


MESSAGES = [
    {"role": "system", "content": "You are a ReAct agent."},
    {"role": "user", "content": "New task: fix the bug."},
    _say("Thought: read the file.\nCalling tools: view(path='a.py')"),  # 2
    _obs("A" + BIG),  # 3
    _say("Thought: run it.\nCalling tools: python(code='run()')"),  # 4
    _obs('Traceback (most recent call last):\n  File "a.py", line 3\nValueError: bad cat'),  # 5
    _say("Thought: fix and run again.\nCalling tools: python(code='fix()')"),  # 6
    _obs("B" + BIG),  # 7
    {"role": "user", "content": "Observation: this one follows a user message, not a call"},  # 8
    _say("Thought: done?"),  # 9
]


def test_off_by_default_nothing_is_a_result() -> None:
    for policy in (StaleToolTruncation(keep=1), FailedCallDetector()):
        assert PolicyPipeline([policy]).apply(MESSAGES).edits == []


def test_pairing() -> None:
    view = observation_view(Trajectory.parse(MESSAGES), "Observation:")
    assert sorted(view.result_of) == [3, 5, 7]  # 8 follows a user message: not a result
    assert [(t.assistant_index, [c.result_index for c in t.calls]) for t in view.tool_turns] == [
        (2, [3]),
        (4, [5]),
        (6, [7]),
    ]
    assert view.text(5).startswith("Traceback")  # the prefix is not part of the result


def test_stale_tool_stubs_old_observations_and_keeps_the_prefix() -> None:
    policy = StaleToolTruncation(keep=1, observation_prefix="Observation:", clear_inputs=True)
    res = PolicyPipeline([policy]).apply(MESSAGES)
    assert [e.index for e in res.edits] == [3, 5]
    stub = "Observation: [stale output of observation elided]"
    assert res.messages[3]["content"] == stub == res.messages[5]["content"]
    assert res.messages[7] == MESSAGES[7] and res.messages[8] == MESSAGES[8]
    assert res.messages[2] == MESSAGES[2]  # no tool_calls to clear on a text action
    assert PolicyPipeline([policy]).apply(res.messages).edits == []  # idempotent


def test_failed_call_stubs_a_failed_observation_once_the_agent_moved_on() -> None:
    policy = FailedCallDetector(observation_prefix="Observation:")
    res = PolicyPipeline([policy]).apply(MESSAGES)
    assert [e.index for e in res.edits] == [5]
    assert res.messages[5]["content"] == (
        "Observation: [failed call elided] observation: ValueError: bad cat"
    )
    assert PolicyPipeline([policy]).apply(res.messages).edits == []
    # the newest failure stays while it is the newest thing the agent saw
    assert PolicyPipeline([policy]).apply(MESSAGES[:6]).edits == []


def test_both_in_a_pipeline_are_idempotent_together() -> None:
    pipe = PolicyPipeline(
        [
            FailedCallDetector(observation_prefix="Observation:"),
            StaleToolTruncation(keep=1, observation_prefix="Observation:"),
        ]
    )
    res = pipe.apply(MESSAGES)
    assert {e.index: e.policy for e in res.edits} == {3: "stale-tool", 5: "failed-call"}
    assert res.messages[5]["content"].startswith("Observation: [failed call elided]")
    again = pipe.apply(res.messages)
    assert again.edits == [] and again.messages == res.messages


def test_a_real_tool_call_turn_is_not_read_as_an_observation() -> None:
    msgs = [
        {"role": "user", "content": "task"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": BIG},
        {"role": "user", "content": "Observation: I typed this myself"},
    ]
    view = observation_view(Trajectory.parse(msgs), "Observation:")
    assert sorted(view.result_of) == [2]
