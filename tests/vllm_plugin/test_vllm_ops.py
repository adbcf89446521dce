"""The EngineCore ops' one definition (``directives/engine_rpc.py``): every op crosses the wire as
JSON and comes back as the same model, an answer is read as its op's answer model, and
``engine_ops.leyline_rpc`` refuses a request that is no op by name (no vLLM needed)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from leyline_agent.directives import engine_rpc as ops
from leyline_agent.errors import DirectiveError
from leyline_agent.vllm_plugin.engine_ops import leyline_rpc

OPS = [
    ops.DescribeOp(),
    ops.LockOp(tokens=(1, 2, 3), salt="leyline-s", stage=2, hold=False),
    ops.ReleaseOp(ids=("lock-1", None)),
    ops.SpliceOp(
        lock_id=None,
        hold_id="head-1",
        tokens=(1, 2, 3),
        start=1,
        end=2,
        replacement=(9,),
        salt="leyline-s",
        repair=ops.RepairBudget(budget=0.05, selector="match+ngram"),
    ),  # fmt: skip
    ops.ForgetOp(tokens=(1, 9, 3), start=1, salt=None, stage=(1, 2, 3)),
    ops.ArriveOp(salt="leyline-s"),
    ops.StatsOp(),
    ops.FlushOp(),
]


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.op)
def test_an_op_crosses_the_wire_unchanged(op):
    assert ops.parse_op(op.model_dump_json()) == op


def test_an_answer_is_read_as_its_ops_answer():
    got = ops.LockOp(tokens=(1,), salt=None).read(
        {"lock_id": None, "cached_tokens": 32, "salt": None}
    )
    assert isinstance(got, ops.LockAnswer) and got.cached_tokens == 32
    with pytest.raises(ValidationError):  # an answer missing a field is not read as one
        ops.ArriveOp(salt="s").read({"lost": True})


@pytest.mark.parametrize(
    "request_json",
    ['{"op": "decay"}', '{"op": "lock", "tokens": [1]}', '{"op": "flush", "extra": 1}', "[]"],
)
def test_a_request_that_is_no_op_is_refused_naming_op(request_json):
    answer = json.loads(leyline_rpc(None, request_json))  # refused before the engine is used
    assert answer["error"]["type"] == "DirectiveError", answer
    assert answer["error"]["message"].startswith("op: "), answer


def test_a_reply_gives_the_answer_or_raises_the_engines_error():
    op = ops.ReleaseOp(ids=("lock-1",))
    assert ops.read_reply(op, ops.answer_json(ops.ReleaseAnswer(released=1))).released == 1
    refused = leyline_rpc(None, '{"op": "decay"}')  # the engine side's own error reply
    with pytest.raises(DirectiveError, match="^op: "):
        ops.read_reply(op, refused)
    crashed = json.dumps({"error": {"type": "InternalError", "message": "KeyError: 3"}})
    with pytest.raises(RuntimeError, match="InternalError: KeyError: 3"):  # answered 500
        ops.read_reply(op, crashed)
