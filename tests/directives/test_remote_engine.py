"""``directives.remote_engine.RemoteEngineBackend`` over a transport written here (no engine,
no vLLM): the ops it sends for one AMORTIZE, its answer, and what a failure after the lock
gives back. The same backend on a real vLLM: ``tests/vllm``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from leyline_agent.directives import engine_rpc as ops
from leyline_agent.directives.modes import ROW_OPS, executed_by
from leyline_agent.directives.remote_engine import RemoteEngineBackend
from leyline_agent.namespaces import Namespace

T = list(range(100, 164))
S, E, R = 40, 50, [7, 8]


class Tokenizer:
    def convert_tokens_to_ids(self, token: str) -> None:
        return None


class Conversations:
    def directive_ran(self, ns: Namespace, req: object) -> None: ...

    def forget_tenant(self, tenant: str) -> int:
        return 0


@dataclass
class Engine:
    """Every op answered as if all of ``T`` were cached; ``fail``: the head prefill (or,
    with ``fills``, the splice) raises; ``fills``: its workers compute rows themselves."""

    fail: bool = False
    fills: bool = False
    sent: list[object] = field(default_factory=list)

    def salt_for(self, ns: Namespace) -> str:
        return "salt-" + ns.session

    async def call(self, request_json: str) -> str:
        op = ops.parse_op(request_json)
        self.sent.append(op)
        if isinstance(op, ops.DescribeOp):
            why = None if self.fills else "model_type: qwen3 layers"
            out: object = ops.DescribeAnswer(
                block_size=32, held_rows=True, max_model_len=4096, model_type="llama",
                vocab_size=1000, workers=(ops.WorkerDescription(repair_problem=why),),
            )  # fmt: skip
        elif isinstance(op, ops.LockOp):
            lock_id = f"lock-{len(self.sent)}" if op.hold else None
            out = ops.LockAnswer(lock_id=lock_id, cached_tokens=len(T), salt=op.salt)
        elif isinstance(op, ops.ReleaseOp):
            out = ops.ReleaseAnswer(released=len(op.ids))
        elif isinstance(op, ops.SpliceOp):
            if self.fail and self.fills:
                return '{"error": {"type": "InternalError", "message": "the engine went away"}}'
            out = ops.SpliceAnswer(
                cached_tokens=len(T) - (E - S) + len(R), new_blocks=1, rotated_tokens=len(T) - E,
                repaired_tokens=0, head_cached_tokens=S, elapsed_s=0.0,
            )  # fmt: skip
        else:
            raise AssertionError(f"op not expected here: {op.op}")
        return ops.answer_json(out)  # type: ignore[arg-type]

    async def prefill(self, ids: list[int], salt: str, hold_id: str | None) -> None:
        self.sent.append(("prefill", list(ids), salt, hold_id))
        if self.fail:
            raise RuntimeError("the engine went away")

    def tokenizer(self) -> Tokenizer:
        return Tokenizer()

    async def render_chat(self, messages: object, tools: object, kwargs: object) -> None:
        return None


def _run(engine: Engine) -> dict:
    backend = RemoteEngineBackend(engine, ["m"], Conversations(), executed_by(ROW_OPS))
    body = {"tokens": T, "directives": [{"start": S, "end": E, "replacement": R}], "session": "a"}
    status, answer = asyncio.run(backend.mount.directives(body, None))
    assert status == 200
    return answer


def test_an_amortize_is_a_staged_lock_a_head_request_and_a_splice():
    engine = Engine()
    answer = _run(engine)
    assert answer["outcome"] == "applied" and answer["tokens"] == T[:S] + R + T[E:]
    assert answer["prefilled_tokens"] == len(R)  # the head's prefix was cached
    assert answer["rotated_tokens"] == len(T) - E
    kinds = [o[0] if isinstance(o, tuple) else o.op for o in engine.sent]
    # the stage holds nothing more: the splice takes the lookup's lock and gives it back
    assert kinds == ["describe", "lock", "lock", "prefill", "splice"]
    stage, head, splice = engine.sent[2], engine.sent[3], engine.sent[4]
    assert stage.stage == S and stage.salt == "salt-a" and not stage.hold
    assert head[1] == T[:S] + R and head[2] == "salt-a"
    assert splice.hold_id == head[3] and splice.lock_id == "lock-2"


def test_a_failure_after_the_lock_gives_back_the_lock_and_the_heads_hold():
    engine = Engine(fail=True)
    with pytest.raises(RuntimeError, match="went away"):
        _run(engine)
    released = [o.ids for o in engine.sent if isinstance(o, ops.ReleaseOp)]
    head_hold = next(o[3] for o in engine.sent if isinstance(o, tuple))
    assert released == [("lock-2", head_hold)]  # the lookup's lock and the head's, once
    assert not any(isinstance(o, ops.SpliceOp) for o in engine.sent)


def test_where_the_workers_compute_rows_an_amortize_is_one_splice_op():
    engine = Engine(fills=True)
    answer = _run(engine)
    assert answer["outcome"] == "applied" and answer["tokens"] == T[:S] + R + T[E:]
    assert answer["prefilled_tokens"] == len(R)
    kinds = [o[0] if isinstance(o, tuple) else o.op for o in engine.sent]
    assert kinds == ["describe", "lock", "splice"]  # no staging, no head request
    splice = engine.sent[2]
    assert splice.hold_id is None and splice.lock_id == "lock-2"
    assert (splice.start, splice.end, list(splice.replacement)) == (S, E, R)


def test_a_failed_splice_op_without_a_head_gives_back_the_lookups_lock_once():
    engine = Engine(fills=True, fail=True)
    with pytest.raises(RuntimeError, match="went away"):
        _run(engine)
    released = [o.ids for o in engine.sent if isinstance(o, ops.ReleaseOp)]
    assert released == [("lock-2", None)]
    assert not any(isinstance(o, tuple) for o in engine.sent)  # no head request
