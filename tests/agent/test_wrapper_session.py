"""ContextSession: per-session diffing, sticky edits, forwarding rules, resets, runtimes."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leyline_agent.agent.session import ContextSession, normalize_reply
from leyline_agent.directives import MessageEdit, Mode
from leyline_agent.errors import RuntimeUnavailableError, TrajectoryError
from leyline_agent.policies import FailedCallDetector, Policy, StaleToolTruncation
from leyline_agent.testing.frameworks import stale_tool_results
from leyline_agent.testing.scripted import ScriptedModel, text_turn, tool_turn
from leyline_agent.wire import DirectivesRequest, DirectivesResponse, StatsResponse

STALE = "[stale output of {} elided]"


def tool_output(name: str, k: int) -> str:
    return f"{name} output {k}\n" + "line\n" * 30


def expected_send(raw: list[dict], keep: int) -> list[dict]:
    """Independently: raw with results of all but the last ``keep`` tool turns stubbed."""
    return stale_tool_results(raw, keep, STALE.replace("{}", "{tool}"))


def agent_loop(session: ContextSession, model: ScriptedModel, turns: int):
    """A minimal agent: keeps its own raw history, runs every tool call, asks the session."""
    raw = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    log = []
    for _ in range(turns):
        plan = session.plan(
            raw, tools=[{"type": "function", "function": {"name": "bash"}}], model="m"
        )
        reply = model(plan.messages_to_send)
        session.observe_reply(reply)
        log.append((copy.deepcopy(raw), plan, reply))
        raw.append(reply)
        for k, tc in enumerate(reply.get("tool_calls") or ()):
            raw.append(
                {
                    "role": "tool",
                    "tool_call_id": tc["id"],
                    "content": tool_output(tc["function"]["name"], k),
                }
            )
    return raw, log


def test_diffing_over_a_loop_forwards_exactly_the_newly_stale_cached_results():
    model = ScriptedModel([tool_turn("bash", {"n": k}) for k in range(7)] + [text_turn("done")])
    session = ContextSession([StaleToolTruncation(keep=2)], session_id="s1", mode=Mode.FORGET)
    _, log = agent_loop(session, model, 8)
    prev_sent, prev_reply = None, None
    for k, (raw, plan, reply) in enumerate(log):
        assert plan.messages_to_send == expected_send(raw, keep=2)
        assert model.prompts[k] == plan.messages_to_send  # what the model saw
        if prev_sent is None:
            assert plan.request is None
        else:
            old = [*prev_sent, normalize_reply(prev_reply)]
            changed = [
                i
                for i, (a, b) in enumerate(zip(old, plan.messages_to_send, strict=False))
                if a != b
            ]
            if changed:
                req = plan.request
                assert (
                    req is not None
                    and req.session == "s1"
                    and req.mode == Mode.FORGET
                    and req.model == "m"
                )
                assert req.old_messages == old
                assert req.new_messages == plan.messages_to_send[: len(old)]
                assert req.tools == [{"type": "function", "function": {"name": "bash"}}]
            else:
                assert plan.request is None
            assert {e.index for e in plan.new_edits if e.index < len(old)} == set(changed)
        prev_sent, prev_reply = plan.messages_to_send, reply
    assert (
        session.stats.requests == 5
        and session.stats.forwarded_edits == 5
        and session.stats.resets == 0
    )


class Fickle(Policy):
    """Stubs only the newest tool result, with a text that changes every turn: the session
    must keep its first edit of each message (sticky) whatever the policy says later."""

    name: ClassVar[str] = "fickle"

    def edits(self, trajectory):
        results = sorted(trajectory.result_of)
        if not results:
            return []
        return [MessageEdit(index=results[-1], content=f"stub@{len(trajectory)}", policy=self.name)]


def test_edits_are_sticky_even_when_the_policy_changes_its_mind():
    model = ScriptedModel([tool_turn("bash") for _ in range(4)])
    session = ContextSession([Fickle()])
    raw, log = agent_loop(session, model, 4)
    final = session.plan(raw)
    results = [i for i, m in enumerate(raw) if m["role"] == "tool"]
    for i in results:
        first = next(
            p.messages_to_send[i]["content"] for r, p, _ in log + [(raw, final, None)] if len(r) > i
        )
        assert final.messages_to_send[i]["content"] == first == f"stub@{i + 1}"
    for (_, earlier, _), (_, later, _) in zip(
        log, log[1:], strict=False
    ):  # append-only apart from edits
        assert later.messages_to_send[: len(earlier.messages_to_send)] == earlier.messages_to_send


def test_edits_of_messages_the_server_has_not_seen_go_into_the_prompt_only():
    session = ContextSession([StaleToolTruncation(keep=1)])
    raw = [{"role": "user", "content": "go"}]
    session.plan(raw)
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
        ],
    }
    session.observe_reply(reply)
    raw += [reply, {"role": "tool", "tool_call_id": "a", "content": "A" * 100}]
    # the agent itself injects a second tool turn before asking again
    raw += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "b", "type": "function", "function": {"name": "view", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "b", "content": "B" * 100},
    ]
    plan = session.plan(raw)
    assert [e.index for e in plan.new_edits] == [2]
    assert plan.messages_to_send[2]["content"] == STALE.format("bash")
    assert plan.request is None  # index 2 >= len(old) == 2: never cached, nothing to splice


def test_history_rewrite_resets_the_session():
    model = ScriptedModel([tool_turn("bash") for _ in range(5)])
    session = ContextSession([StaleToolTruncation(keep=1)])
    raw, _ = agent_loop(session, model, 4)
    assert len(session.sticky_edits) == 2
    rewritten = [raw[0], {"role": "user", "content": "summary of earlier work"}, *raw[-4:]]
    plan = session.plan(rewritten)
    assert session.stats.resets == 1
    assert plan.request is None
    assert plan.messages_to_send == expected_send(rewritten, keep=1)
    assert [e.index for e in session.sticky_edits] == [3]


def _calls(cid: str, name: str = "bash") -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}}
        ],
    }


def test_an_agent_turn_in_place_of_the_reply_keeps_the_session_and_the_cached_reply():
    session = ContextSession([StaleToolTruncation(keep=1)])
    raw = [{"role": "user", "content": "go"}]
    session.plan(raw)
    session.observe_reply(_calls("model-1"))
    raw += [
        _calls("x"),
        {"role": "tool", "tool_call_id": "x", "content": "X" * 80},
    ]  # scripted turn
    plan = session.plan(raw)
    assert (
        plan.request is None and session.stats.resets == 0 and session.stats.replaced_replies == 1
    )
    sent = plan.messages_to_send
    session.observe_reply(_calls("model-2", "view"))
    raw += [_calls("y"), {"role": "tool", "tool_call_id": "y", "content": "Y" * 80}]
    plan = session.plan(raw)
    req = plan.request
    assert req is not None and session.stats.resets == 0
    assert req.old_messages == [*sent, normalize_reply(_calls("model-2", "view"))]  # what is cached
    assert req.new_messages == [*plan.messages_to_send[: len(sent)], req.old_messages[-1]]
    assert [
        i for i, (a, b) in enumerate(zip(req.old_messages, req.new_messages, strict=True)) if a != b
    ] == [2]


@pytest.mark.parametrize("replaced", [False, True])
def test_an_edit_of_a_replaced_reply_is_not_forwarded(replaced):
    def failing_call(cid):
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": cid,
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"x": 1}'},
                }
            ],
        }

    session = ContextSession([FailedCallDetector()])
    raw = [{"role": "user", "content": "go"}]
    session.plan(raw)
    session.observe_reply(failing_call("s"))
    echo = failing_call("other" if replaced else "s")
    cid = echo["tool_calls"][0]["id"]
    raw += [
        echo,
        {"role": "tool", "tool_call_id": cid, "content": "Error: boom"},
        _calls("t"),
        {"role": "tool", "tool_call_id": "t", "content": "ok"},
    ]
    plan = session.plan(raw)  # the failure is moved past: its arguments (1) and result (2)
    assert [e.index for e in plan.new_edits] == [1, 2]
    assert plan.messages_to_send[1]["tool_calls"][0]["function"]["arguments"] == "{}"
    if replaced:  # the cache holds the model's reply, not the message the edit is about
        assert plan.request is None
    else:  # the cached reply is that message: its edit is forwarded, the result's is not cached
        assert plan.request is not None and len(plan.request.old_messages) == 2
        assert plan.request.new_messages[1] == plan.messages_to_send[1]


def test_sdk_extras_in_the_echoed_reply_are_not_a_divergence_and_a_retry_is_not_either():
    session = ContextSession([StaleToolTruncation(keep=1)])
    raw = [{"role": "user", "content": "go"}]
    first = session.plan(raw)
    again = session.plan(raw)  # the call failed; the agent retries
    assert again == first and session.stats.resets == 0
    session.observe_reply(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
            ],
        }
    )
    echo = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": [],
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
        ],
    }
    session.plan([*raw, echo, {"role": "tool", "tool_call_id": "a", "content": "x"}])
    assert session.stats.resets == 0


def test_without_an_observed_reply_the_agents_echo_is_the_cached_reply():
    session = ContextSession([StaleToolTruncation(keep=1)])
    raw = [{"role": "user", "content": "go"}]
    session.plan(raw)

    def call(cid):
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": "bash", "arguments": "{}"}}
            ],
        }

    raw += [call("a"), {"role": "tool", "tool_call_id": "a", "content": "A"}]
    session.plan(raw)
    raw += [call("b"), {"role": "tool", "tool_call_id": "b", "content": "B"}]
    plan = session.plan(raw)
    assert plan.request is not None
    assert plan.request.old_messages[-1] == normalize_reply(call("b"))
    assert len(plan.request.old_messages) == 4


def test_bad_messages_raise_and_leave_the_session_as_it_was():
    session = ContextSession([StaleToolTruncation(keep=1)])
    raw = [{"role": "user", "content": "go"}]
    first = session.plan(raw)
    with pytest.raises(TrajectoryError, match=r"messages\[1\]\.role"):
        session.plan([*raw, {"content": "no role"}])
    assert session.stats.turns == 1 and session.plan(raw) == first


class RecordingRuntime:
    def __init__(self, fail: BaseException | None = None):
        self.requests: list[DirectivesRequest] = []
        self.fail = fail

    def apply_directives(self, request):
        self.requests.append(request)
        if self.fail is not None:
            raise self.fail
        return DirectivesResponse(tokens=[], applied=[], fallback=True)

    def stats(self):
        return StatsResponse()


class AsyncRecordingRuntime(RecordingRuntime):
    async def apply_directives(self, request):  # type: ignore[override]
        await asyncio.sleep(0)
        return super().apply_directives(request)


def _loop_with(session, n=4):
    model = ScriptedModel([tool_turn("bash") for _ in range(n)])
    raw = [{"role": "user", "content": "go"}]
    sent = []
    for _ in range(n):
        sent.append(session.prepare(raw))
        reply = model(sent[-1])
        session.observe_reply(reply)
        raw += [
            reply,
            {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "out " * 40},
        ]
    return raw, sent


def test_prepare_sends_each_planned_request_to_the_runtime():
    rt = RecordingRuntime()
    session = ContextSession([StaleToolTruncation(keep=1)], rt)
    raw, sent = _loop_with(session)
    assert len(rt.requests) == 2 == session.stats.runtime_calls == session.stats.server_fallbacks
    for req, prompt in zip(rt.requests, sent[2:], strict=True):
        assert req.new_messages == prompt[: len(req.new_messages)]


def test_runtime_failure_is_counted_and_the_call_goes_through():
    rt = RecordingRuntime(fail=ConnectionError("down"))
    session = ContextSession([StaleToolTruncation(keep=1)], rt)
    raw, sent = _loop_with(session)
    assert session.stats.runtime_failures == 2 and len(rt.requests) == 2
    assert sent[-1] == expected_send(raw[: len(sent[-1])], keep=1)


def test_runtime_failure_raises_without_fallback_and_base_exceptions_always_propagate():
    strict = ContextSession(
        [StaleToolTruncation(keep=1)],
        RecordingRuntime(fail=ConnectionError("down")),
        fallback=False,
    )
    with pytest.raises(RuntimeUnavailableError, match="down"):
        _loop_with(strict)
    interrupted = ContextSession(
        [StaleToolTruncation(keep=1)], RecordingRuntime(fail=KeyboardInterrupt())
    )
    with pytest.raises(KeyboardInterrupt):
        _loop_with(interrupted)


def test_aprepare_with_an_async_runtime():
    rt = AsyncRecordingRuntime()
    session = ContextSession([StaleToolTruncation(keep=1), FailedCallDetector()], rt)

    async def main():
        raw = [{"role": "user", "content": "go"}]
        for k in range(4):
            await session.aprepare(raw)
            reply = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"c{k}",
                        "type": "function",
                        "function": {"name": "bash", "arguments": json.dumps({"k": k})},
                    }
                ],
            }
            session.observe_reply(reply)
            raw += [reply, {"role": "tool", "tool_call_id": f"c{k}", "content": "out " * 40}]

    asyncio.run(main())
    assert len(rt.requests) == 2 and session.stats.runtime_calls == 2


OUTPUTS = [
    "ok",
    "Error: nope",
    "Traceback (most recent call last):\nOSError: x",
    "y" * 200,
    "exit code 2",
]


@settings(max_examples=60, deadline=None)
@given(
    outputs=st.lists(
        st.lists(st.sampled_from(OUTPUTS), min_size=1, max_size=2), min_size=1, max_size=8
    ),
    keep=st.integers(1, 3),
    with_failed=st.booleans(),
    clear_at_least=st.sampled_from([0, 100]),
)
def test_property_sent_history_is_append_only_except_at_forwarded_edits(
    outputs, keep, with_failed, clear_at_least
):
    policies = [StaleToolTruncation(keep=keep, clear_at_least=clear_at_least, clear_inputs=True)]
    if with_failed:
        policies.append(FailedCallDetector())
    session = ContextSession(policies)
    raw = [{"role": "user", "content": "task"}]
    prev_sent, prev_reply = None, None
    frozen: dict[int, dict] = {}  # index -> message as first edited
    for k, outs in enumerate([*outputs, []]):
        plan = session.plan(raw)
        sent = plan.messages_to_send
        if prev_sent is not None:
            old = [*prev_sent, normalize_reply(prev_reply)]
            changed = [i for i, (a, b) in enumerate(zip(old, sent, strict=False)) if a != b]
            if plan.request is None:
                assert changed == []
            else:
                assert plan.request.old_messages == old
                assert plan.request.new_messages == sent[: len(old)]
                assert changed == sorted(e.index for e in plan.new_edits if e.index < len(old))
        for i, m in frozen.items():  # sticky: an edited message never changes again
            assert sent[i] == m
        for e in plan.new_edits:
            frozen[e.index] = sent[e.index]
        reply = {
            "role": "assistant",
            "content": f"turn {k}",
            "tool_calls": [
                {
                    "id": f"c{k}_{j}",
                    "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"k": k, "j": j})},
                }
                for j in range(len(outs))
            ],
        }
        if not outs:
            del reply["tool_calls"]
        session.observe_reply(reply)
        raw = [
            *raw,
            reply,
            *(
                {"role": "tool", "tool_call_id": f"c{k}_{j}", "content": o}
                for j, o in enumerate(outs)
            ),
        ]
        prev_sent, prev_reply = sent, reply
    assert session.stats.resets == 0


def test_a_reply_echoed_with_reserialized_arguments_is_the_same_reply():
    """pydantic-ai sends the model's tool call back with its arguments re-serialized
    (compact JSON): still the model's reply, not an agent turn in its place. Arguments that
    differ as JSON values are another reply."""
    for echoed, replaced in (('{"path":"a.py","n":[1,2]}', 0), ('{"path":"b.py","n":[1,2]}', 1)):
        session = ContextSession([StaleToolTruncation(keep=1)])
        raw = [{"role": "user", "content": "go"}]
        session.plan(raw)
        reply = _calls("c1")
        reply["tool_calls"][0]["function"]["arguments"] = '{"path": "a.py", "n": [1, 2]}'
        session.observe_reply(reply)
        echo = _calls("c1")
        echo["tool_calls"][0]["function"]["arguments"] = echoed
        raw += [echo, {"role": "tool", "tool_call_id": "c1", "content": "X"}]
        session.plan(raw)
        assert session.stats.resets == 0
        assert session.stats.replaced_replies == replaced, echoed
