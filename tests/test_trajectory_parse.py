"""Trajectory.parse: turns, tool-call/result pairing, and every malformed input."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from leyline_agent.directives import MessageEdit
from leyline_agent.errors import LeylineError, TrajectoryError
from leyline_agent.trajectory import Trajectory, apply_edits, estimate_tokens, message_text

DATA = Path(__file__).parent / "data" / "trajectory_10turn.json"


def _call(cid: str, name: str = "bash", args: str = "{}") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _base() -> list[dict]:
    return [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [_call("a"), _call("b", "view")]},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "assistant", "content": "done"},
    ]


def test_pairing_and_turns_on_the_fixture():
    raw = json.loads(DATA.read_text())
    before = copy.deepcopy(raw)
    traj = Trajectory.parse(raw)
    assert raw == before
    # independent walk: every tool message answers the call with its id
    ids = {}
    for i, m in enumerate(raw):
        for tc in m.get("tool_calls") or ():
            ids[tc["id"]] = (i, tc["function"]["name"])
    for i, m in enumerate(raw):
        if m["role"] == "tool":
            call = traj.result_of[i]
            assert (call.message_index, call.name) == ids[m["tool_call_id"]]
            assert call.result_index == i
    assistants = [i for i, m in enumerate(raw) if m["role"] == "assistant"]
    assert list(traj.assistant_indices) == assistants
    assert [t.assistant_index for t in traj.tool_turns] == [
        i for i in assistants if raw[i].get("tool_calls")
    ]
    for i in range(len(raw)):
        assert traj.turn_of[i] == sum(1 for a in assistants if a <= i) - 1


def test_parallel_results_pair_out_of_order_and_pending_calls_are_allowed():
    msgs = _base()
    traj = Trajectory.parse(msgs)
    assert traj.calls["a"].result_index == 4 and traj.calls["b"].result_index == 3
    assert traj.tool_turns[0].result_indices == (4, 3)
    pending = msgs[:3]
    traj = Trajectory.parse(pending)
    assert traj.calls["a"].result_index is None and traj.tool_turns[0].result_indices == ()


def test_parse_copies_so_caller_list_is_never_touched():
    msgs = _base()
    traj = Trajectory.parse(msgs)
    traj.messages[0]["content"] = "changed"
    assert msgs[0]["content"] == "s"


def test_content_parts_and_token_estimate():
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "abcd"}, {"type": "text", "text": "efgh"}],
        }
    ]
    traj = Trajectory.parse(msgs)
    assert message_text(msgs[0]) == "abcdefgh"
    assert traj.tokens(0) == 2
    assert estimate_tokens("") == 0 and estimate_tokens("abcde") == 2
    assert traj.tokens(0, count=len) == 8


def _mutate(path_fn):
    msgs = _base()
    path_fn(msgs)
    return msgs


BAD = [
    ("not-a-list", lambda: {"role": "user"}, "messages:"),
    ("string", lambda: "hello", "messages:"),
    ("item-not-object", lambda: [{"role": "user", "content": "x"}, 3], "messages[1]:"),
    ("missing-role", lambda: _mutate(lambda m: m[1].pop("role")), "messages[1].role: missing"),
    ("bad-role", lambda: _mutate(lambda m: m[1].update(role="robot")), "messages[1].role"),
    ("missing-content", lambda: _mutate(lambda m: m[1].pop("content")), "messages[1].content"),
    ("content-number", lambda: _mutate(lambda m: m[0].update(content=5)), "messages[0].content"),
    (
        "bad-part",
        lambda: _mutate(lambda m: m[1].update(content=[{"text": "x"}])),
        "messages[1].content[0]",
    ),
    (
        "assistant-empty",
        lambda: _mutate(lambda m: m[5].update(content=None)),
        "messages[5].content",
    ),
    (
        "calls-not-list",
        lambda: _mutate(lambda m: m[2].update(tool_calls={"id": "a"})),
        "messages[2].tool_calls",
    ),
    (
        "call-no-id",
        lambda: _mutate(lambda m: m[2]["tool_calls"][1].pop("id")),
        "messages[2].tool_calls[1].id",
    ),
    (
        "call-bad-type",
        lambda: _mutate(lambda m: m[2]["tool_calls"][0].update(type="x")),
        "messages[2].tool_calls[0].type",
    ),
    (
        "call-no-name",
        lambda: _mutate(lambda m: m[2]["tool_calls"][0]["function"].pop("name")),
        "tool_calls[0].function.name",
    ),
    (
        "args-dict",
        lambda: _mutate(lambda m: m[2]["tool_calls"][0]["function"].update(arguments={})),
        "tool_calls[0].function.arguments",
    ),
    (
        "dup-call-id",
        lambda: _mutate(lambda m: m[2]["tool_calls"][1].update(id="a")),
        "messages[2].tool_calls[1].id",
    ),
    (
        "calls-on-user",
        lambda: _mutate(lambda m: m[1].update(tool_calls=[_call("z")])),
        "messages[1].tool_calls",
    ),
    (
        "tool-no-id",
        lambda: _mutate(lambda m: m[3].pop("tool_call_id")),
        "messages[3].tool_call_id: missing",
    ),
    (
        "tool-unmatched",
        lambda: _mutate(lambda m: m[3].update(tool_call_id="zz")),
        "messages[3].tool_call_id: 'zz' matches no",
    ),
    (
        "tool-twice",
        lambda: _mutate(lambda m: m[4].update(tool_call_id="b")),
        "messages[4].tool_call_id: call 'b' was already answered by messages[3]",
    ),
    (
        "tool-before-call",
        lambda: [{"role": "tool", "tool_call_id": "a", "content": "x"}],
        "messages[0].tool_call_id",
    ),
]


@pytest.mark.parametrize("name,make,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_index_and_field(name, make, needle):
    msgs = make()
    before = copy.deepcopy(msgs)
    with pytest.raises(TrajectoryError) as info:
        Trajectory.parse(msgs)
    assert needle in str(info.value)
    assert isinstance(info.value, LeylineError)
    assert msgs == before


def test_apply_edits_is_a_copy_and_checks_the_index():
    msgs = _base()
    out = apply_edits(msgs, [MessageEdit(index=3, content="stub", policy="p")])
    assert out[3]["content"] == "stub" and msgs[3]["content"] == "B"
    assert out[:3] == msgs[:3] and out[4:] == msgs[4:]
    with pytest.raises(TrajectoryError, match=r"edits\[0\]\.index: 9"):
        apply_edits(msgs, [MessageEdit(index=9, content="x", policy="p")])
