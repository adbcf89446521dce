"""The calls between a front process and an engine process that holds a paged prefix cache,
typed: one frozen model per op, each naming its answer (torch-free, engine-free).

A server whose engine runs in another process (vLLM's API server and EngineCore; SGLang's
TokenizerManager and Scheduler have the same split) asks it for the directive steps that
touch the cache: ``describe`` what it supports, ``lock`` a base's cached rows by namespace,
``splice``, ``forget``, ``release``, ``arrive`` (a namespace's pinned result lost?),
``stats`` and ``flush``. A namespace travels as the engine's own key of it (``salt``:
vLLM's ``cache_salt``). A request is the op's JSON; ``op`` tells the ops apart
(``parse_op``); a reply is ``{"ok": ANSWER}`` (``answer_json``; ``read_reply`` gives the
op's answer back) or ``{"error": {"type", "message"}}`` with the Leyline error's class name.
The front's side: ``directives.remote_engine``; vLLM's engine side: ``vllm_plugin.engine_ops``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from leyline_agent.errors import (
    CacheMissError,
    DirectiveError,
    LeylineError,
    RuntimeUnavailableError,
)

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
    "read_reply",
    "serve_op",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- answers ---------------------------------------------------------------------------
class WorkerDescription(BaseModel):
    """One worker's description (vLLM's: ``vllm_plugin.worker``): why it cannot splice
    (``problem``, ``field``) or REPAIR (``repair_problem``), and its cache's facts."""

    model_config = ConfigDict(frozen=True, extra="allow")
    problem: str | None = None
    field: str | None = None
    repair_problem: str | None = None  # also why it cannot compute ``R``'s rows in a splice
    block_size: int | None = None


class DescribeAnswer(_Frozen):
    """What the engine supports here (``problem``/``field``: why not) and its facts."""

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
    head_cached_tokens: int  # rows of ``T[:start] + R`` found computed (no head: ``start``)
    elapsed_s: float


class ForgetAnswer(_Frozen):
    dropped_blocks: int
    salt: str | None


class ArriveAnswer(_Frozen):
    lost: bool  # the namespace's last splice result lost rows (said once)
    watched: bool  # the namespace is still watched (else the front stops asking)


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
        """The op's answer from the ``ok`` of its reply."""
        return cast(A, self.answer.model_validate(ok))


class RepairBudget(_Frozen):
    """REPAIR's row choice (``directives.repair``), as the front resolved it."""

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
    """``T[start:end]`` replaced by ``replacement`` in ``T``'s cached rows (held by
    ``lock_id``). ``hold_id``: the head request's rows of ``T[:start] + R``; None: the engine
    computes ``R``'s rows itself, inside the op, over ``T[:start]``'s cached rows (the
    workers' row forward, where ``WorkerDescription.repair_problem`` is None)."""

    op: Literal["splice"] = "splice"
    answer: ClassVar[type[BaseModel]] = SpliceAnswer
    lock_id: str | None
    hold_id: str | None
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
    """The op of a request (``pydantic.ValidationError`` naming the field)."""
    return _OP.validate_json(request_json)


def answer_json(answer: BaseModel) -> str:
    return json.dumps({"ok": answer.model_dump(mode="json")})


_ERRORS = {e.__name__: e for e in (CacheMissError, DirectiveError, RuntimeUnavailableError)}


def read_reply[A: BaseModel](op: Op[A], reply_json: str) -> A:
    """``op``'s answer from the engine's reply, or its error raised: a Leyline error as its
    class, any other as ``RuntimeError`` (a 500)."""
    reply = json.loads(reply_json)
    if "error" in reply:
        err = reply["error"]
        cls = _ERRORS.get(err["type"])
        if cls is None:
            raise RuntimeError(f"{err['type']}: {err['message']}")
        raise cls(err["message"])
    return op.read(reply["ok"])


def serve_op[E](
    engine: E, handlers: Mapping[type[BaseModel], Callable[[E, Any], BaseModel]], request_json: str
) -> str:
    """The engine's side: the op of ``request_json`` run by its handler, the reply as JSON.
    A request that is no op is a ``DirectiveError`` naming ``op``; errors travel back as
    ``{"error": {"type", "message"}}`` (any error that is not a Leyline one, logged, as
    ``InternalError``: the front answers 500), never as an exception through the engine's
    call machinery."""
    try:
        try:
            op = parse_op(request_json)
        except ValidationError as e:
            raise DirectiveError(f"op: not a Leyline op ({e.errors()[0]['msg']})") from None
        return answer_json(handlers[type(op)](engine, op))
    except LeylineError as e:
        return json.dumps({"error": {"type": type(e).__name__, "message": str(e)}})
    except Exception as e:  # noqa: BLE001 - reported to the front, which answers 500
        logging.getLogger(__name__).exception("leyline op failed")
        error = {"type": "InternalError", "message": f"{type(e).__name__}: {e}"}
        return json.dumps({"error": error})
