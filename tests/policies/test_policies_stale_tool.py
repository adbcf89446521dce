"""StaleToolTruncation: every knob, against positions the builder recorded while building."""

from __future__ import annotations

import copy
import json

import pytest

from leyline_agent.errors import PolicyError
from leyline_agent.policies import StaleToolTruncation
from leyline_agent.policies.pipeline import PolicyPipeline
from leyline_agent.testing.trajectories import TrajectoryBuilder

TOOLS = ["bash", "view", "bash", "pytest", "view", "bash"]


def build(n: int = 6, size: int = 200) -> TrajectoryBuilder:
    t = TrajectoryBuilder().user("fix the bug")
    for k in range(n):
        name = TOOLS[k % len(TOOLS)]
        t.tool_turn((name, {"arg": k}, f"{name} output {k} " + "z" * size), content=f"step {k}")
        if k == 2:
            t.user("keep going")
    return t.text("done")


def stale_results(t: TrajectoryBuilder, keep: int) -> list[int]:
    return [i for turn in range(max(0, t.num_tool_turns - keep)) for i in t.result_indices(turn)]


def run(policy, messages):
    before = copy.deepcopy(messages)
    res = PolicyPipeline([policy]).apply(messages)
    assert messages == before  # never modified in place
    again = PolicyPipeline([policy]).apply(res.messages)  # idempotent
    assert again.edits == [] and again.messages == res.messages
    return res


def changed(a: list[dict], b: list[dict]) -> list[int]:
    assert len(a) == len(b)
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


@pytest.mark.parametrize("keep", [1, 2, 3, 5, 6, 9])
def test_keep_stubs_exactly_results_older_than_last_keep_tool_turns(keep):
    t = build()
    msgs = t.messages
    res = run(StaleToolTruncation(keep=keep), msgs)
    expect = stale_results(t, keep)
    assert changed(msgs, res.messages) == expect
    assert [e.index for e in res.edits] == expect
    for i in expect:
        name = next(
            tc["function"]["name"]
            for m in msgs
            for tc in m.get("tool_calls") or ()
            if tc["id"] == msgs[i]["tool_call_id"]
        )
        assert res.messages[i] == {**msgs[i], "content": f"[stale output of {name} elided]"}


def test_parallel_calls_age_together_and_pending_calls_are_ignored():
    t = TrajectoryBuilder().user("u")
    t.tool_turn(("view", {"p": "a"}, "A" * 50), ("view", {"p": "b"}, "B" * 50))
    t.tool_turn(("bash", {}, "C" * 50))
    t.tool_turn(("bash", {}, None))  # pending: the model asked, no result yet
    msgs = t.messages
    res = run(StaleToolTruncation(keep=2), msgs)
    assert changed(msgs, res.messages) == t.result_indices(0)


def test_placeholder_and_tool_name():
    t = build()
    res = run(StaleToolTruncation(keep=2, placeholder="<cleared {tool}>"), t.messages)
    assert {res.messages[i]["content"] for i in stale_results(t, 2)} == {
        "<cleared bash>",
        "<cleared view>",
        "<cleared pytest>",
    }


def test_exclude_tools():
    t = build()
    msgs = t.messages
    res = run(StaleToolTruncation(keep=1, exclude_tools=["view"]), msgs)
    expect = [i for i in stale_results(t, 1) if "view output" not in msgs[i]["content"]]
    assert len(expect) < len(stale_results(t, 1))
    assert changed(msgs, res.messages) == expect


def test_min_tokens_leaves_small_outputs():
    t = TrajectoryBuilder().user("u")
    t.tool_turn(("bash", {}, "x" * 40))  # 10 estimated tokens (chars / 4)
    t.tool_turn(("bash", {}, "y" * 400))  # 100
    t.tool_turn(("bash", {}, "ok"))
    msgs = t.messages
    assert changed(msgs, run(StaleToolTruncation(keep=1, min_tokens=10), msgs).messages) == [
        *t.result_indices(0),
        *t.result_indices(1),
    ]
    assert changed(
        msgs, run(StaleToolTruncation(keep=1, min_tokens=11), msgs).messages
    ) == t.result_indices(1)
    # an exact counter: words
    words = StaleToolTruncation(keep=1, min_tokens=2, count_tokens=lambda s: len(s.split()))
    assert changed(msgs, run(words, msgs).messages) == []


def _chars_total(msgs: list[dict]) -> int:
    total = 0
    for m in msgs:
        total += len(m.get("content") or "")
        for tc in m.get("tool_calls") or ():
            total += len(tc["function"]["name"]) + len(tc["function"]["arguments"])
    return total


def test_trigger_tokens_acts_only_above_the_context_size():
    t = build()
    msgs = t.messages
    total = _chars_total(msgs)
    assert (
        run(StaleToolTruncation(keep=2, trigger_tokens=total, count_tokens=len), msgs).edits == []
    )
    res = run(StaleToolTruncation(keep=2, trigger_tokens=total - 1, count_tokens=len), msgs)
    assert changed(msgs, res.messages) == stale_results(t, 2)


def test_clear_inputs_stubs_arguments_of_stubbed_calls_only():
    t = build()
    msgs = t.messages
    res = run(StaleToolTruncation(keep=2, clear_inputs=True, exclude_tools=["pytest"]), msgs)
    stubbed = set(changed(msgs, res.messages))
    for turn in range(t.num_tool_turns):
        a = t.call_index(turn)
        old, new = msgs[a]["tool_calls"], res.messages[a]["tool_calls"]
        assert [c["id"] for c in new] == [c["id"] for c in old]
        is_stale = turn < t.num_tool_turns - 2 and old[0]["function"]["name"] != "pytest"
        assert (new[0]["function"]["arguments"] == "{}") == is_stale
        assert (a in stubbed) == (is_stale and old[0]["function"]["arguments"] != "{}")
        assert new[0]["function"]["name"] == old[0]["function"]["name"]
        assert res.messages[a]["content"] == msgs[a]["content"]


def test_clear_at_least_batches_edits():
    t = build(n=4, size=100)
    msgs = t.messages
    stale = stale_results(t, 2)
    saved = sum(
        len(msgs[i]["content"]) - len(StaleToolTruncation().stub(_name(msgs, i))) for i in stale
    )
    assert (
        run(StaleToolTruncation(keep=2, clear_at_least=saved + 1, count_tokens=len), msgs).edits
        == []
    )
    res = run(StaleToolTruncation(keep=2, clear_at_least=saved, count_tokens=len), msgs)
    assert changed(msgs, res.messages) == stale


def _name(msgs, i):
    cid = msgs[i]["tool_call_id"]
    return next(
        tc["function"]["name"] for m in msgs for tc in m.get("tool_calls") or () if tc["id"] == cid
    )


def test_content_parts_are_replaced_by_the_stub():
    t = TrajectoryBuilder().user("u")
    t.tool_turn(("bash", {}, "x")).tool_turn(("bash", {}, "y")).tool_turn(("bash", {}, "z"))
    msgs = t.messages
    i = t.result_indices(0)[0]
    msgs[i]["content"] = [
        {"type": "text", "text": "part one"},
        {"type": "text", "text": "part two"},
    ]
    res = run(StaleToolTruncation(keep=2), msgs)
    assert res.messages[i]["content"] == "[stale output of bash elided]"


@pytest.mark.parametrize(
    "knobs,needle",
    [
        ({"keep": 0}, "stale-tool.keep"),
        ({"keep": -3}, "stale-tool.keep"),
        ({"keep": "two"}, "stale-tool.keep"),
        ({"placeholder": ""}, "stale-tool.placeholder"),
        ({"min_tokens": -1}, "stale-tool.min_tokens"),
        ({"trigger_tokens": -5}, "stale-tool.trigger_tokens"),
        ({"clear_at_least": -1}, "stale-tool.clear_at_least"),
        ({"clear_inputs": "maybe"}, "stale-tool.clear_inputs"),
        ({"exclude_tools": 3}, "stale-tool.exclude_tools"),
        ({"kepp": 2}, "stale-tool.kepp"),
    ],
)
def test_bad_knobs_name_the_knob(knobs, needle):
    with pytest.raises(PolicyError, match=needle.replace(".", r"\.")):
        StaleToolTruncation(**knobs)


def test_serialize_round_trips_through_json():
    p = StaleToolTruncation(keep=3, exclude_tools=["view"], min_tokens=5)
    data = json.loads(json.dumps(p.serialize()))
    assert data["name"] == "stale-tool"
    q = StaleToolTruncation(**{k: v for k, v in data.items() if k != "name"})
    t = build()
    assert PolicyPipeline([q]).apply(t.messages) == PolicyPipeline([p]).apply(t.messages)
