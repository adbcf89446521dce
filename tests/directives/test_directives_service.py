"""``directives.service.DirectiveService`` over a backend written here (no model, no torch):
the order of its steps, what it counts, what it releases, and a new verb.

The backend keeps a token list per namespace as its "cache" and executes a plan by
splicing that list, dispatching on each directive's mode rule by its tail operation; the
expected sequences are built here with list slicing, not with the service's code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from leyline_agent import edits
from leyline_agent.directives import modes
from leyline_agent.directives.pipeline import Plan, applied_answer
from leyline_agent.directives.service import (
    DirectiveService,
    ServedModel,
    run_inline,
)
from leyline_agent.directives.validate import RequestLimits
from leyline_agent.edits import Mode
from leyline_agent.errors import CacheMissError, RequestError, UnsupportedModeError
from leyline_agent.namespaces import Namespace
from leyline_agent.wire import Counters, DirectivesRequest, DirectivesResponse


@dataclass
class Held:
    length: int


@dataclass
class ListBackend:
    """A cache of one token list per namespace key; ``ops``: the row operations it runs."""

    ops: frozenset[str]
    cached: dict[str, list[int]] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    held: int = 0
    log: list[str] = field(default_factory=list)
    fail_on: int | None = None  # a start position whose directive fails mid-execution

    @property
    def executes(self) -> frozenset[Mode]:
        return modes.executed_by(self.ops)

    async def hold(self, base: list[int], ns: Namespace) -> Held:
        have = self.cached.get(ns.key, [])
        n = 0
        while n < min(len(have), len(base)) and have[n] == base[n]:
            n += 1
        self.held += 1
        self.log.append(f"hold {n}")
        return Held(n)

    async def execute(self, plan: Plan, held: Held, ns: Namespace) -> DirectivesResponse:
        tokens = list(plan.base)
        for d in plan.order:  # check all, then mutate
            if d.start == self.fail_on:
                raise CacheMissError(f"directives: span [{d.start}, {d.end}) was evicted")
        for d in plan.order:
            rule = modes.rule_of(d.mode, self.executes)
            tail = {"move": "moved", "prefill": "prefilled", "decay": "decayed"}[rule.tail]
            self.log.append(f"{d.mode.value} {tail}")
            tokens = tokens[: d.start] + list(d.replacement) + tokens[d.end :]
        self.cached[ns.key] = tokens
        splices = {m.value: sum(d.mode is m for d in plan.order) for m in self.executes}
        return applied_answer(plan, splices=splices, reused=0, prefilled=0, rotated=0)

    async def release(self, held: Held, ns: Namespace, answer: DirectivesResponse | None) -> None:
        self.held -= 1
        self.log.append("release")

    async def count(self, ns: Namespace, update: Callable[[Counters], None]) -> None:
        update(self.counters)


T = list(range(100, 120))
NS = Namespace("t", "s")


@pytest.fixture
def service() -> DirectiveService:
    return DirectiveService(ServedModel("m", None, RequestLimits(vocab_size=1000), None))


def _run(service: DirectiveService, backend: ListBackend, body: dict) -> DirectivesResponse:
    req, ns = service.admit(body, lambda s: NS)
    return run_inline(service.run(req, ns, backend))


def test_a_batch_runs_right_to_left_and_is_counted(service):
    be = ListBackend(frozenset({"move", "prefill"}), {NS.key: list(T)})
    body = {"tokens": T, "directives": [
        {"start": 2, "end": 4, "replacement": [1]},
        {"start": 10, "end": 11, "replacement": [2, 3], "mode": "forget"},
    ]}  # fmt: skip
    out = _run(service, be, body)
    want = T[:2] + [1] + T[4:10] + [2, 3] + T[11:]
    assert out.tokens == want and be.cached[NS.key] == want
    assert be.log == ["hold 20", "forget prefilled", "amortize moved", "release"]
    assert be.counters.splices == {"amortize": 1, "forget": 1} and be.held == 0


def test_a_refused_batch_changes_nothing_and_counts_one_error(service):
    be = ListBackend(frozenset({"move", "prefill"}), {NS.key: list(T)}, fail_on=2)
    body = {"tokens": T, "directives": [
        {"start": 2, "end": 4, "replacement": [1]}, {"start": 10, "end": 11, "replacement": [2]},
    ]}  # fmt: skip
    with pytest.raises(CacheMissError):
        _run(service, be, body)
    assert be.cached[NS.key] == T and be.held == 0 and be.log[-1] == "release"
    assert be.counters.directive_errors == 1 and be.counters.splices == {"amortize": 0, "forget": 0}
    with pytest.raises(CacheMissError):  # not cached at all: the pipeline's miss, counted too
        _run(service, be, {"tokens": [7, 8, 9], "directives": [{"start": 0, "end": 1}]})
    assert be.counters.directive_errors == 2 and be.held == 0


def test_a_miss_only_the_backend_sees_is_a_counted_fallback_when_asked(service):
    """A batch the backend refuses with a miss before its first write (a span its earlier
    splices would leave uncached): with ``fallback`` the answer is ``fallback`` (T' as asked,
    nothing executed), counted in ``fallbacks``, not in ``directive_errors``; the cache is
    as it was."""
    be = ListBackend(frozenset({"move", "prefill"}), {NS.key: list(T)}, fail_on=2)
    body = {"tokens": T, "fallback": True, "directives": [
        {"start": 2, "end": 4, "replacement": [1]}, {"start": 10, "end": 11, "replacement": [2]},
    ]}  # fmt: skip
    out = _run(service, be, body)
    assert out.outcome == "fallback" and out.fallback and out.splices == {}
    assert out.tokens == T[:2] + [1] + T[4:10] + [2] + T[11:]
    assert be.cached[NS.key] == T and be.held == 0 and be.log[-1] == "release"
    assert be.counters.fallbacks == 1 and be.counters.directive_errors == 0
    assert be.counters.splices == {"amortize": 0, "forget": 0}


def test_a_request_id_runs_once_per_namespace(service):
    be = ListBackend(frozenset({"move", "prefill"}), {NS.key: list(T)})
    body = {"tokens": T, "directives": [{"start": 2, "end": 4, "replacement": [1]}],
            "request_id": "r"}  # fmt: skip
    first = _run(service, be, body)
    assert _run(service, be, body) == first
    assert be.log.count("amortize moved") == 1


def test_a_new_verb_runs_only_where_its_row_operation_is(service, monkeypatch):
    """DECAY added by one rule: refused by name by a backend without "decay" (before the
    cache is asked anything), executed by one that implements it, never as another mode."""
    monkeypatch.setitem(modes.RULES, Mode.DECAY, modes.ModeRule(Mode.DECAY, "decay", False))
    monkeypatch.setattr(edits, "RESERVED_MODES", frozenset({Mode.PIN, Mode.SCRATCH}))
    body = {"tokens": T, "directives": [{"start": 2, "end": 4, "replacement": [1],
                                         "mode": "decay"}]}  # fmt: skip
    without = ListBackend(frozenset({"move", "prefill", "recompute"}), {NS.key: list(T)})
    with pytest.raises(UnsupportedModeError, match=r"directives\[0\]\.mode: 'decay'"):
        _run(service, without, body)
    assert without.log == [] and without.cached[NS.key] == T

    with_op = ListBackend(frozenset({"move", "prefill", "decay"}), {NS.key: list(T)})
    out = _run(service, with_op, body)
    assert with_op.log == ["hold 20", "decay decayed", "release"]
    assert out.tokens == T[:2] + [1] + T[4:] and with_op.counters.splices["decay"] == 1


def test_a_server_made_request_is_checked_before_the_cache_is_asked():
    """``run_made`` (a chat turn's edits): the limits first, so an oversized request is
    refused naming its field with nothing held or counted; a fitting one runs."""
    svc = DirectiveService(ServedModel("m", None, RequestLimits(1000, max_prompt_tokens=21), None))
    be = ListBackend(frozenset({"move", "prefill"}), {NS.key: list(T)})
    too_long = DirectivesRequest(
        tokens=T, directives=[{"start": 2, "end": 3, "replacement": [1, 2, 3]}]
    )
    with pytest.raises(RequestError) as info:
        asyncio.run(svc.run_made(too_long, NS, be))
    assert info.value.field == "directives" and be.log == [] and be.counters == Counters()
    fits = DirectivesRequest(tokens=T, directives=[{"start": 2, "end": 3, "replacement": [1, 2]}])
    out = asyncio.run(svc.run_made(fits, NS, be))
    assert out.tokens == T[:2] + [1, 2] + T[3:] and be.log[-1] == "release"


def test_ordered_runs_a_namespace_one_at_a_time(service):
    seen: list[str] = []

    async def one(tag: str, ns: Namespace) -> None:
        async with service.ordered(ns):
            seen.append(f"in {tag}")
            await asyncio.sleep(0.01)
            seen.append(f"out {tag}")

    async def main() -> None:
        a, b = Namespace("t", "a"), Namespace("t", "b")
        await asyncio.gather(one("a1", a), one("a2", a), one("b1", b))

    asyncio.run(main())
    assert seen.index("out a1") < seen.index("in a2")  # a's second waited for its first
    assert seen.index("in b1") < seen.index("out a1")  # another namespace did not wait
    assert service._locks == {}


def test_run_inline_refuses_a_coroutine_that_suspends():
    async def suspends() -> int:
        await asyncio.sleep(0)
        return 1

    with pytest.raises(RuntimeError, match="suspended"):
        run_inline(suspends())
