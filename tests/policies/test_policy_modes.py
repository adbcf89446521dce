"""Policies choose their splice: ``stale-tool`` / ``failed-call`` ``mode`` and ``budget`` knobs
reach the directives their edits compile into (pure parts; over HTTP:
``test_policy_modes_http``)."""

from __future__ import annotations

import pytest

from leyline_agent.agent.session import ContextSession
from leyline_agent.directives import MessageEdit, Mode
from leyline_agent.directives.body_edits import request_edits
from leyline_agent.directives.modes import turn_mode
from leyline_agent.errors import PolicyError, RequestError
from leyline_agent.policies import PolicyPipeline
from leyline_agent.policies.registry import load_policy


def _history(turns: int) -> list[dict]:
    msgs: list[dict] = [{"role": "user", "content": "Fix the bug."}]
    for k in range(turns):
        call = {"id": f"c{k}", "type": "function",
                "function": {"name": "run", "arguments": f'{{"n": {k}}}'}}  # fmt: skip
        msgs += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": f"output {k} " * 20},
        ]
    return msgs


def test_turn_mode_is_the_most_exact_asked():
    assert turn_mode([], Mode.AMORTIZE) == (Mode.AMORTIZE, None)
    assert turn_mode([(None, None)], "forget") == (Mode.FORGET, None)
    assert turn_mode([("amortize", None), ("repair", 0.1), ("repair", 0.3)], "amortize") == (
        Mode.REPAIR,
        0.3,
    )
    assert turn_mode([("repair", 0.3), ("forget", None)], "amortize") == (Mode.FORGET, None)
    assert turn_mode([("repair", None)], "amortize") == (Mode.REPAIR, None)


@pytest.mark.parametrize("policy", ["stale-tool", "failed-call"])
@pytest.mark.parametrize(
    ("knobs", "field"),
    [
        ({"mode": "sideways"}, "mode"),
        ({"mode": "pin"}, "mode"),
        ({"mode": "amortize", "budget": 0.1}, "budget"),
        ({"mode": "repair", "budget": 1.5}, "budget"),
    ],
)
def test_bad_mode_knobs_are_refused_by_name(policy, knobs, field):
    with pytest.raises(PolicyError) as e:
        load_policy({"name": policy, **knobs})
    assert policy in str(e.value) and ("budget" if field == "budget" else "mode") in str(e.value)


def test_stale_tool_edits_carry_the_mode_and_the_pipeline_keeps_the_most_exact():
    stale = load_policy({"name": "stale-tool", "keep": 1, "mode": "repair", "budget": 0.05})
    edits = PolicyPipeline([stale]).apply(_history(3)).edits
    assert edits and {(e.mode, e.budget) for e in edits} == {(Mode.REPAIR, 0.05)}
    plain = PolicyPipeline([load_policy({"name": "stale-tool", "keep": 1})]).apply(_history(3))
    assert {e.mode for e in plain.edits} == {None}
    # failed-call (forget) and stale-tool (repair) on the same message: forget
    hist = _history(3)
    hist[2]["content"] = "Traceback (most recent call last):\nError: boom"
    both = PolicyPipeline([load_policy({"name": "failed-call", "mode": "forget"}), stale]).apply(
        hist
    )
    by_index = {e.index: e for e in both.edits}
    assert by_index[2].mode is Mode.FORGET and by_index[2].budget is None


def test_session_forwards_the_policy_mode():
    stale = load_policy({"name": "stale-tool", "keep": 1, "mode": "repair", "budget": 0.05})
    s = ContextSession([stale])
    hist = _history(1)
    s.plan(hist)
    s.observe_reply(_history(2)[3])
    plan = s.plan(_history(2))
    assert plan.request is not None
    assert plan.request.mode is Mode.REPAIR and plan.request.budget == 0.05
    field = s.leyline_field(plan)
    assert field["client_edits"] == "repair"
    assert field["edits"][0]["mode"] == "repair" and field["edits"][0]["budget"] == 0.05


def test_body_edits_with_a_mode_set_the_turn_mode_and_bad_ones_are_400():
    msgs = _history(2)
    body = {"edits": [{"index": 2, "content": "[stale]", "mode": "repair", "budget": 0.04}]}
    out = request_edits(body, msgs)
    assert out.options == {"client_edits": "repair", "repair_budget": 0.04}
    assert out.edits[0] == MessageEdit(
        index=2, content="[stale]", policy="client", mode="repair", budget=0.04
    )
    forget = {"client_edits": "forget", "edits": [{"index": 2, "content": "x", "mode": "repair"}]}
    assert request_edits(forget, msgs).options == {"client_edits": "forget"}
    for bad, param in [
        ({"index": 2, "content": "x", "mode": "sideways"}, "leyline.edits[0].mode"),
        ({"index": 2, "content": "x", "mode": "decay"}, "leyline.edits[0].mode"),
        ({"index": 2, "content": "x", "mode": "forget", "budget": 0.1}, "leyline.edits[0]"),
        (
            {"index": 2, "content": "x", "mode": "repair", "budget": "0.1"},
            "leyline.edits[0].budget",
        ),
    ]:
        with pytest.raises(RequestError) as e:
            request_edits({"edits": [bad]}, msgs)
        assert (e.value.field or "").startswith(param), (bad, e.value.field, str(e.value))
