"""Replay of agent trajectories against the embedded engine, C sessions in flight.

In-process, on purpose, and one job at a time: C sessions in flight means C agents whose
turns queue in front of one engine that serves them in turn (FIFO). The replay reproduces
that scheduling in virtual time: each job runs for real on the engine, its measured service
time advances a virtual clock, and a session's next job is queued when its previous one
finishes (no think time). Latency = queue wait + service time. This keeps Python thread
and GIL jitter of a client living in the same process out of the numbers, and makes the
interleaving (hence the cache contents under eviction) deterministic.

Arms compared side by side run interleaved (``replay_interleaved``): each has its own engine
and virtual clock, and their jobs are taken in turn, so a change of machine load during the
run lands on every arm alike instead of on whichever arm was running.

A job is one whole turn: the policies' plan, the turn's directives (splice / forget arms),
the chat template render and the chat request. That is how ``leyline serve`` runs an edit
that comes with its request (``context_management``, ``--client-edits``): the directive is
an engine operation just before the request's first step, not a second request that queues
behind every other session's. A splice turn's TTFT therefore includes its directive.

Arms (how the next prompt is built and what runs before it):
- ``full``: the unedited history; the prefix cache only (the upper bound on hits);
- ``radix``: the policies edit the history (ContextSession, no runtime): every edit costs
  a re-prefill from the edit point, as production engines do today;
- ``splice``: the same edits, forwarded to the engine as AMORTIZE directives first;
- ``forget``: the same, as FORGET directives;
- ``nocache``: the edited history with the prefix cache off.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from leyline_agent.directives import Mode
from leyline_agent.errors import LeylineError
from leyline_agent.namespaces import Namespace

from .trajectories import TrajectoryRecord

__all__ = ["ARMS", "Sample", "replay", "replay_interleaved"]

ARMS = ("full", "radix", "splice", "forget", "nocache")
_MODES = {"splice": Mode.AMORTIZE, "forget": Mode.FORGET}


@dataclass(slots=True)
class Sample:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    ttft_s: float
    e2e_s: float
    queue_s: float
    directive_s: float


@dataclass(slots=True)
class _Done:
    value: Any
    start: float
    service: float


Job = Callable[[], Any]
SessionGen = Generator[Job, _Done, None]


@dataclass(slots=True)
class CountingRuntime:
    """The engine as a ``Runtime``, adding up what its directives prefill and rotate."""

    engine: Any
    prefilled_tokens: int = 0
    rotated_tokens: int = 0

    def apply_directives(self, request: Any) -> Any:
        resp = self.engine.apply_directives(request)
        self.prefilled_tokens += resp.prefilled_tokens
        self.rotated_tokens += resp.rotated_tokens
        return resp

    def stats(self) -> Any:
        return self.engine.stats()


@dataclass(slots=True)
class ReplayResult:
    samples: list[Sample] = field(default_factory=list)
    peak_cache_tokens: int = 0
    makespan_s: float = 0.0
    session_stats: list[Any] = field(default_factory=list)
    runtime: CountingRuntime | None = None


def personalize(traj: TrajectoryRecord, sid: int) -> TrajectoryRecord:
    """Session ``sid``'s copy: its first user message names the session, so sessions that
    replay the same trajectory share the system prompt and tools but not their history."""
    msgs = [dict(m) for m in traj.messages]
    for m in msgs:
        if m.get("role") == "user":
            m["content"] = f"[session {sid}] {m.get('content') or ''}"
            break
    return traj.model_copy(update={"messages": msgs})


def _session(
    engine: Any,
    arm: str,
    traj: TrajectoryRecord,
    sid: int,
    policies: list[Any],
    max_turns: int | None,
    max_tokens: int,
    out: ReplayResult,
) -> SessionGen:
    from leyline_agent.agent.session import ContextSession
    from leyline_agent.engine.engine import SamplingParams

    session = None
    if arm != "full":
        runtime = out.runtime if arm in _MODES else None
        session = ContextSession(
            policies, runtime, mode=_MODES.get(arm, Mode.AMORTIZE), session_id=f"{arm}-s{sid}"
        )
        out.session_stats.append(session.stats)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    # every arm names its session, as a wrapped client does: spliced rows are the session's
    ns = Namespace(session=f"{arm}-s{sid}")
    for turn, a in enumerate(traj.request_points(max_turns)):
        history = traj.messages[:a]
        done = yield (lambda h=history: _turn(engine, session, h, traj.tools, params, ns))
        res, directive_s, generate_at = done.value
        if session is not None:
            session.observe_reply({"role": "assistant", "content": res.text})
        out.samples.append(
            Sample(
                session=sid,
                turn=turn,
                prompt_tokens=res.prompt_tokens,
                cached_tokens=res.cached_tokens,
                prefilled_tokens=res.prefilled_tokens,
                ttft_s=done.start + generate_at + res.ttft_s,
                e2e_s=0.0,
                queue_s=0.0,
                directive_s=directive_s,
            )
        )


def _turn(
    engine: Any, session: Any, history: list[dict], tools: Any, params: Any, ns: Namespace
) -> tuple[Any, float, float]:
    """One turn as one job: the plan (and the directives, when the session has a runtime),
    the render, the chat request. Returns the result, the directives' seconds and when the
    chat request started (seconds into the job)."""
    t0 = time.perf_counter()
    directive_s = 0.0
    if session is None:
        to_send = history
    elif session.runtime is None:
        to_send = session.plan(history, tools).messages_to_send
    else:
        to_send = session.prepare(history, tools)
        directive_s = time.perf_counter() - t0
    ids = engine.render(to_send, tools)
    generate_at = time.perf_counter() - t0
    return engine.generate(ids, params, namespace=ns), directive_s, generate_at


def replay(engine: Any, arm: str, trajectories: list[TrajectoryRecord], **kw: Any) -> ReplayResult:
    """Replay ``sessions`` sessions (trajectory ``i % len``), ``concurrency`` in flight: one
    arm of ``replay_interleaved``, which takes the same keywords."""
    (res,) = replay_interleaved([(engine, arm)], trajectories, **kw)
    return res


def replay_interleaved(
    targets: list[tuple[Any, str]],
    trajectories: list[TrajectoryRecord],
    *,
    concurrency: int,
    sessions: int,
    policies_factory: Callable[[], list[Any]],
    max_turns: int | None,
    max_tokens: int = 8,
) -> list[ReplayResult]:
    """One replay per ``(engine, arm)``, their jobs taken in turn: job k of every arm runs
    before job k + 1 of any, so a change of machine load lands on every arm alike and the
    arms' ratios are taken under the same load. Each arm keeps its own virtual clock."""
    for _, arm in targets:
        if arm not in ARMS:
            raise LeylineError(f"--arms: unknown arm {arm!r}; known: {', '.join(ARMS)}")
    runs = [
        _run(engine, arm, trajectories, concurrency, sessions, policies_factory, max_turns,
             max_tokens)
        for engine, arm in targets
    ]  # fmt: skip
    live = [next(r) for r in runs]  # each paused before its first job
    active = list(range(len(runs)))
    while active:
        for i in list(active):
            try:
                next(runs[i])
            except StopIteration as done:
                live[i] = done.value
                active.remove(i)
    return live


def _run(
    engine: Any,
    arm: str,
    trajectories: list[TrajectoryRecord],
    concurrency: int,
    sessions: int,
    policies_factory: Callable[[], list[Any]],
    max_turns: int | None,
    max_tokens: int,
) -> Generator[Any, None, ReplayResult]:
    """The replay of one arm, pausing before each job; returns its result."""
    out = ReplayResult(runtime=CountingRuntime(engine))
    clock = 0.0
    heap: list[tuple[float, int, int]] = []  # (ready time, session id, tiebreak)
    gens: dict[int, SessionGen] = {}
    pending: dict[int, Job] = {}
    turn_start: dict[int, float] = {}
    queue_wait: dict[int, float] = {}
    next_sid = 0

    def admit(at: float) -> None:
        nonlocal next_sid
        sid = next_sid
        next_sid += 1
        g = _session(
            engine,
            arm,
            personalize(trajectories[sid % len(trajectories)], sid),
            sid,
            policies_factory(),
            max_turns,
            max_tokens,
            out,
        )
        job = next(g, None)
        if job is not None:
            gens[sid], pending[sid] = g, job
            turn_start[sid], queue_wait[sid] = at, 0.0
            heapq.heappush(heap, (at, sid, 0))

    for _ in range(min(concurrency, sessions)):
        admit(0.0)
    yield out
    while heap:
        ready, sid, _ = heapq.heappop(heap)
        start = max(clock, ready)
        queue_wait[sid] += start - ready
        n_samples = len(out.samples)
        t0 = time.perf_counter()
        value = pending[sid]()
        service = time.perf_counter() - t0
        clock = start + service
        out.peak_cache_tokens = max(out.peak_cache_tokens, engine.stats().cache_tokens)
        try:
            pending[sid] = gens[sid].send(_Done(value, start, service))
        except StopIteration:
            pending.pop(sid)
            gens.pop(sid)
        if len(out.samples) > n_samples:  # a chat request finished: the turn is complete
            s = out.samples[-1]
            s.queue_s = queue_wait[sid]
            s.ttft_s -= turn_start[sid]  # (generate start + engine TTFT) - turn start
            s.e2e_s = clock - turn_start[sid]
            turn_start[sid], queue_wait[sid] = clock, 0.0
        if sid in pending:
            heapq.heappush(heap, (clock, sid, 0))
        elif next_sid < sessions:
            admit(clock)
        yield out
    out.makespan_s = clock
    return out
