"""The EngineCore ops of the plugin, typed: one frozen model per op, each naming its answer.

The route (API server) and ``engine_ops`` (EngineCore) speak through vLLM's utility call
``leyline_rpc(request_json) -> answer_json``; these models are both ends of it. ``op`` tells
the ops apart (``parse_op``); a reply is ``{"ok": ANSWER}`` (``answer_json``; the op's
``read`` gives its answer back) or ``{"error": {"type", "message"}}``. Torch-free, vLLM-free: the API server
imports it. What each op does: ``engine_ops``.
"""

from __future__ import annotations

import json
from typing import Annotated, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

__all__ = [
    "ArriveAnswer",
    "AnyOp",
    "ArriveOp",
    "DescribeAnswer",
    "DescribeOp",
    "FlushAnswer",
    "FlushOp",
    "ForgetAnswer",
    "ForgetOp",
    "LockAnswer",
    "LockOp",
    "Op",
    "ReleaseAnswer",
    "ReleaseOp",
    "RepairBudget",
    "SpliceAnswer",
    "SpliceOp",
    "StatsAnswer",
    "StatsOp",
    "WorkerDescription",
    "answer_json",
    "parse_op",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- answers ---------------------------------------------------------------------------
class WorkerDescription(BaseModel):
    """One worker's ``leyline_describe`` (``worker.LeylineWorkerExtension``): why it cannot
    splice (``problem``, ``field``) or REPAIR (``repair_problem``), and its cache's facts."""

    model_config = ConfigDict(frozen=True, extra="allow")
    problem: str | None = None
    field: str | None = None
    repair_problem: str | None = None
    block_size: int | None = None


class DescribeAnswer(_Frozen):
    """What the plugin supports here (``problem``/``field``: why not) and the route's facts."""

    problem: str | None = None
    field: str | None = None
    block_size: int | None = None
    held_rows: bool = False  # rows past a sequence's last full block are kept
    workers: tuple[WorkerDescription, ...] = ()
    tp: int | None = None
    max_model_len: int
    model_type: str | None
    vocab_size: int


class LockAnswer(_Frozen):
    lock_id: str | None  # None: nothing cached, or the hold already given back
    cached_tokens: int
    salt: str | None  # the namespace ``T`` was found in


class ReleaseAnswer(_Frozen):
    released: int  # how many of the ids were held


class SpliceAnswer(_Frozen):
    cached_tokens: int
    new_blocks: int
    rotated_tokens: int
    repaired_tokens: int
    head_cached_tokens: int
    elapsed_s: float


class ForgetAnswer(_Frozen):
    dropped_blocks: int
    salt: str | None


class ArriveAnswer(_Frozen):
    lost: bool  # the namespace's last splice result lost rows (said once)
    watched: bool  # the namespace is still watched (else the route stops asking)


class StatsAnswer(_Frozen):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    cache_tokens: int
    cache_capacity_tokens: int
    held: int
    held_rows: int
    pinned_tokens: int
    pin_evictions: int


class FlushAnswer(_Frozen):
    flushed_tokens: int
    kept_tokens: int
    dropped_pins: int


# -- ops -------------------------------------------------------------------------------
class Op[A: BaseModel](_Frozen):
    """An op whose answer is an ``A`` (``answer``: that class, for ``read``)."""

    answer: ClassVar[type[BaseModel]]

    def read(self, ok: object) -> A:
        """The op's answer from the ``ok`` of ``leyline_rpc``'s reply."""
        return cast(A, self.answer.model_validate(ok))


class RepairBudget(_Frozen):
    """REPAIR's row choice (``directives.repair``), as the route resolved it."""

    budget: float
    selector: str


class DescribeOp(Op[DescribeAnswer]):
    op: Literal["describe"] = "describe"
    answer: ClassVar[type[BaseModel]] = DescribeAnswer


class LockOp(Op[LockAnswer]):
    """Hold ``tokens``' cached blocks (``stage``: also keep ``T[:stage]``'s rows for the next
    request; ``hold=False``: give the hold back in the same op)."""

    op: Literal["lock"] = "lock"
    answer: ClassVar[type[BaseModel]] = LockAnswer
    tokens: tuple[int, ...]
    salt: str | None
    stage: int | None = None
    hold: bool = True


class ReleaseOp(Op[ReleaseAnswer]):
    op: Literal["release"] = "release"
    answer: ClassVar[type[BaseModel]] = ReleaseAnswer
    ids: tuple[str | None, ...]  # a None (nothing was locked) is skipped


class SpliceOp(Op[SpliceAnswer]):
    op: Literal["splice"] = "splice"
    answer: ClassVar[type[BaseModel]] = SpliceAnswer
    lock_id: str | None
    hold_id: str
    tokens: tuple[int, ...]
    start: int
    end: int
    replacement: tuple[int, ...]
    salt: str
    repair: RepairBudget | None = None


class ForgetOp(Op[ForgetAnswer]):
    op: Literal["forget"] = "forget"
    answer: ClassVar[type[BaseModel]] = ForgetAnswer
    tokens: tuple[int, ...]
    start: int
    salt: str | None
    stage: tuple[int, ...] | None = None


class ArriveOp(Op[ArriveAnswer]):
    op: Literal["arrive"] = "arrive"
    answer: ClassVar[type[BaseModel]] = ArriveAnswer
    salt: str


class StatsOp(Op[StatsAnswer]):
    op: Literal["stats"] = "stats"
    answer: ClassVar[type[BaseModel]] = StatsAnswer


class FlushOp(Op[FlushAnswer]):
    op: Literal["flush"] = "flush"
    answer: ClassVar[type[BaseModel]] = FlushAnswer


AnyOp = Annotated[
    DescribeOp | LockOp | ReleaseOp | SpliceOp | ForgetOp | ArriveOp | StatsOp | FlushOp,
    Field(discriminator="op"),
]
_OP: TypeAdapter[AnyOp] = TypeAdapter(AnyOp)


def parse_op(request_json: str) -> AnyOp:
    """The op of a ``leyline_rpc`` request (``pydantic.ValidationError`` naming the field)."""
    return _OP.validate_json(request_json)


def answer_json(answer: BaseModel) -> str:
    return json.dumps({"ok": answer.model_dump(mode="json")})
