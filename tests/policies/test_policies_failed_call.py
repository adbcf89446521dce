"""FailedCallDetector: detection, the moved-past rules, the stub, knobs, idempotence."""

from __future__ import annotations

import copy
import json

import pytest

from leyline_agent.errors import PolicyError
from leyline_agent.policies import FailedCallDetector
from leyline_agent.policies.pipeline import PolicyPipeline
from leyline_agent.testing.trajectories import TrajectoryBuilder

TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "app.py", line 3, in <module>\n'
    "    main()\n"
    '  File "app.py", line 2, in main\n'
    "    raise KeyError('x')\n"
    "KeyError: 'x'\n"
)


def run(policy, messages):
    before = copy.deepcopy(messages)
    res = PolicyPipeline([policy]).apply(messages)
    assert messages == before
    again = PolicyPipeline([policy]).apply(res.messages)
    assert again.edits == [] and again.messages == res.messages
    return res


def changed(a, b):
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def failing(output: str, tool: str = "bash") -> TrajectoryBuilder:
    t = TrajectoryBuilder().user("u")
    t.tool_turn((tool, {"cmd": "run it"}, output))
    t.tool_turn(("bash", {"cmd": "fixed"}, "all good"))
    return t


@pytest.mark.parametrize(
    "output,error_line",
    [
        (TRACEBACK, "KeyError: 'x'"),
        ("ValueError: bad value\nmore", "ValueError: bad value"),
        ("compiling...\nerror: expected ';' before '}'\n", "error: expected ';' before '}'"),
        ("fatal: not a git repository", "fatal: not a git repository"),
        ("running\nProcess exited with exit code 2", "Process exited with exit code 2"),
        ("bash: foo: command not found", "bash: foo: command not found"),
        (
            "Invalid line number, line numbers are 1-based.",
            "Invalid line number, line numbers are 1-based.",
        ),
        ("Unknown tool 'grep' requested.", "Unknown tool 'grep' requested."),
        ("ERROR running tool", "ERROR running tool"),
    ],
)
def test_default_patterns_and_first_error_line(output, error_line):
    t = failing(output)
    msgs = t.messages
    res = run(FailedCallDetector(), msgs)
    r, a = t.result_indices(0)[0], t.call_index(0)
    assert changed(msgs, res.messages) == [a, r]
    assert res.messages[r] == {**msgs[r], "content": f"[failed call elided] bash: {error_line}"}
    assert "\n" not in res.messages[r]["content"]
    assert res.messages[a]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert res.messages[a]["tool_calls"][0]["id"] == msgs[a]["tool_calls"][0]["id"]


@pytest.mark.parametrize(
    "output",
    [
        "a.py b.py",
        "..F\nE   AssertionError: assert 1 == 2\n1 failed, 2 passed",  # failing tests: the tool worked
        "   1 def f():\n   2     error = compute()\n   3     return error",
        "exit code 0",
        "no errors found",
    ],
)
def test_successful_outputs_are_not_failures(output):
    msgs = failing(output).messages
    assert run(FailedCallDetector(), msgs).edits == []


def test_newest_failure_is_never_removed():
    t = TrajectoryBuilder().user("u")
    t.tool_turn(("bash", {}, "ok"))
    t.tool_turn(
        ("bash", {"c": 1}, TRACEBACK), ("view", {"path": "a"}, "fine")
    )  # sibling succeeded, same turn
    msgs = t.messages
    assert run(FailedCallDetector(), msgs).edits == []
    msgs.append({"role": "user", "content": "what happened?"})
    assert run(FailedCallDetector(), msgs).edits == []  # still the newest thing the agent saw
    msgs.append({"role": "assistant", "content": "It failed; let me look."})
    res = run(FailedCallDetector(), msgs)
    assert changed(msgs, res.messages) == [t.call_index(1), t.result_indices(1)[0]]
    # only the failed call's arguments, not its sibling's
    calls = res.messages[t.call_index(1)]["tool_calls"]
    assert calls[0]["function"]["arguments"] == "{}"
    assert calls[1] == msgs[t.call_index(1)]["tool_calls"][1]


def test_after_counts_later_assistant_turns_unless_a_later_call_succeeded():
    t = TrajectoryBuilder().user("u")
    t.tool_turn(("bash", {"c": 1}, "Error: one"))
    t.tool_turn(("bash", {"c": 2}, "Error: two"))
    t.tool_turn(("bash", {"c": 3}, "Error: three"))
    msgs = t.messages
    r0, r1, r2 = (t.result_indices(k)[0] for k in range(3))
    # after=2: only the first failure has two later assistant turns
    res = run(FailedCallDetector(after=2), msgs)
    assert changed(msgs, res.messages) == [t.call_index(0), r0]
    res = run(FailedCallDetector(after=1), msgs)
    assert changed(msgs, res.messages) == [t.call_index(0), r0, t.call_index(1), r1]
    # a later call that succeeds: every earlier failure is moved past at once
    t.tool_turn(("bash", {}, "it works"))
    msgs = t.messages
    res = run(FailedCallDetector(after=5), msgs)
    assert [i for i in changed(msgs, res.messages) if msgs[i]["role"] == "tool"] == [r0, r1, r2]


def test_custom_patterns_exclude_tools_and_stub_arguments():
    t = TrajectoryBuilder().user("u")
    t.tool_turn(("bash", {"c": 1}, "BOOM at step 3"))
    t.tool_turn(("view", {"path": "x"}, "Traceback (most recent call last):\nKeyError: 1"))
    t.tool_turn(("bash", {}, "ok"))
    msgs = t.messages
    res = run(FailedCallDetector(patterns=[r"BOOM"]), msgs)
    assert changed(msgs, res.messages) == [t.call_index(0), t.result_indices(0)[0]]
    res = run(FailedCallDetector(exclude_tools=["view"]), msgs)
    assert changed(msgs, res.messages) == []  # BOOM is not a default pattern; view is excluded
    res = run(FailedCallDetector(stub_arguments=False), msgs)
    assert changed(msgs, res.messages) == [t.result_indices(1)[0]]
    res = run(FailedCallDetector(), msgs)
    assert changed(msgs, res.messages) == [t.call_index(1), t.result_indices(1)[0]]


def test_placeholder_matching_a_pattern_is_still_idempotent_and_truncates():
    t = failing("Error: " + "x" * 500)
    msgs = t.messages
    p = FailedCallDetector(placeholder="ERROR: {tool} failed earlier ({error})", max_error_chars=20)
    res = run(p, msgs)  # run() checks idempotence
    r = t.result_indices(0)[0]
    assert res.messages[r]["content"] == "ERROR: bash failed earlier (Error: xxxxxxxxxx...)"


@pytest.mark.parametrize(
    "knobs,needle",
    [
        ({"after": 0}, "failed-call.after"),
        ({"patterns": ["("]}, "failed-call.patterns"),
        ({"patterns": []}, "failed-call.patterns"),
        ({"max_error_chars": 2}, "failed-call.max_error_chars"),
        ({"placeholder": ""}, "failed-call.placeholder"),
        ({"treshold": 1}, "failed-call.treshold"),
    ],
)
def test_bad_knobs(knobs, needle):
    with pytest.raises(PolicyError, match=needle.replace(".", r"\.")):
        FailedCallDetector(**knobs)


def test_the_fixture_failed_edit_is_stubbed():
    from pathlib import Path

    msgs = json.loads((Path(__file__).resolve().parents[1] / "data" / "trajectory_10turn.json").read_text())
    res = run(FailedCallDetector(), msgs)
    bad = [
        i for i, m in enumerate(msgs) if m["role"] == "tool" and m["content"].startswith("Invalid")
    ]
    assert len(bad) == 1
    call = next(
        i
        for i, m in enumerate(msgs)
        if any(tc["id"] == msgs[bad[0]]["tool_call_id"] for tc in m.get("tool_calls") or ())
    )
    assert changed(msgs, res.messages) == [call, bad[0]]


@pytest.mark.parametrize(
    ("text", "failed"),
    [
        ("An error occurred while running the tool. Please try again. Error: boom", True),
        ("<returncode>1</returncode>\n<output>\nls: cannot access 'x'\n</output>", True),
        ("<returncode>-9</returncode>\n<output>\n</output>", True),
        ("<returncode>0</returncode>\n<output>\na.py\nb.py\n</output>", False),
        ("<returncode>0</returncode>\n<output>\n10 errors were fixed\n</output>", False),
    ],
)
def test_framework_failure_formats_are_detected(text, failed):
    """The OpenAI Agents SDK's tool-error answer and mini-swe-agent's return codes."""
    assert FailedCallDetector().is_failure(text) is failed
