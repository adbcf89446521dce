"""The engine's step loop: schedule -> run one batch -> post-process, on one thread.

``Stepper`` holds the running sequences and one step thread (started when a sequence
arrives, gone after ``IDLE_S`` with nothing to run). The step thread repeats: under the
engine lock, one step for *all* running sequences; each sequence's new tokens go to its
``events``. A thread that generates (``Engine.generate``) adds its sequence and waits for
its events, handing them to its ``on_token`` on its own thread while the step thread is
already running the next step (so a client's streaming overlaps the forward). When the
sequence has finished stepping, its owner commits it (cache insert, counters) or, if
``on_token`` raised (a client left) or the step failed, aborts it: its rows are freed and
nothing is cached or counted. After a step in which sequences finished, the step thread
waits up to ``HANDOFF_S`` for their owners to take the lock, so an answer is committed and
returned between two steps instead of after the next one. So callbacks never run inside a
step, and everything else that touches the engine (directives, stats, render) takes the
same lock: it runs between steps. One thread drives every step: the owners' threads would otherwise hand the engine
lock (and the GIL) around between steps (measured: 8 sequences at 1 torch thread took 74-79
ms a step that way, against 54 ms for the same batch run alone).

``exclusive()`` is that lock, fair to non-step work: a waiting operation makes the step
thread pause after its current step.

``halt(error)`` (a server's shutdown deadline): from the end of the step in progress on,
every running sequence, and every one that arrives, fails with ``error`` instead of
stepping again, so a long prompt stops between two of its prefill chunks; its owner aborts
it (rows freed, nothing cached or counted). It does not wait for the step in progress.

``prefill`` runs rows that no one samples from (a splice's ``R``, ``executor.py``) as a
sequence of the loop: chunked under the step budget and batched with the other sequences'
decodes (``scheduler.py`` paces such chunks while other sessions' sequences run, and for
``PACE_HOLD_S`` after the last of them), so a long replacement never stops another session's
stream, nor holds the next request of a client between two of its requests. Its owner waits outside the lock; the rows it reads
(the prefix) must be held by the owner for as long as it runs.

Slots: a prefill chunk gets one allocation (a run of slots). A decoding sequence takes its
rows from a block of up to ``DECODE_BLOCK`` slots allocated ahead (``Sequence.reserved``;
what is left is freed when it finishes): with one allocation per token, the rows of eight
sequences decoding side by side would interleave, and attention, which reads a sequence's
rows run by run as views of the pool, would have to gather them. The first block comes in
the same allocation as the prompt's last chunk, so an agent's next turn (its context
cached, a few new prompt tokens) decodes over two runs: the cached rows, then its own.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.cache.radix import Match
from leyline_agent.engine.detokenizer import Detokenizer
from leyline_agent.engine.model.runner import ModelRunner, StepInput
from leyline_agent.engine.params import SamplingParams
from leyline_agent.engine.sampler import Sampler, mask_batch
from leyline_agent.engine.scheduler import schedule, step_tokens_for
from leyline_agent.engine.sequence import SeqStatus, Sequence
from leyline_agent.namespaces import Namespace

__all__ = ["DECODE_BLOCK", "Stepper"]

DECODE_BLOCK = 128
IDLE_S = 0.5  # the step thread exits after this long with nothing to run
# A step that carries paced rows beside decodes should take between 1 + PACE_LOW and
# 1 + PACE_HIGH decode steps: a streaming client's gap grows by at most about that much.
PACE_LOW, PACE_HIGH = 0.5, 0.9
# The sizes a paced share takes: a few, so that the forwards' shapes repeat (oneDNN and the
# attention kernels set up each new row count once; a share that wandered over every size
# would pay that set-up in many steps).
PACED_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PACED_FIRST = 3  # index of the share before anything was measured (4 tokens)
DECODE_WINDOW = 15  # decode-only steps whose median is the reference decode step
EXTRA_WEIGHT = 0.5  # the newest step's weight in a size's remembered extra length
PROBE_STEPS = 32  # paced steps before a size known to be too long is tried again
# Pacing holds this long after the last step that ran another session's sequence: a client
# streams request after request, and between two of them (its answer committed, its next
# prompt not yet running: a few ms to tens of ms) a paced prefill alone would take the whole
# step budget, a step the next request then waits for (measured: 100-200 ms of 512 tokens
# at 4k context). A share that doubled per step alone would reach 512 tokens within such a
# pause (measured: 161 ms gaps at 8k). Past the hold the splice runs at the full budget.
PACE_HOLD_S = 0.25
# After a step in which sequences stopped stepping, the step thread waits up to this long
# for their owners to take the lock (``exclusive``) before it starts the next step: the
# owner commits (cache insert, counters) and answers between the two steps instead of
# after the next one (a step is 50-300 ms at 2-8k context with others' prefill chunks in
# it; an owner takes well under a millisecond to get there).
HANDOFF_S = 0.01


class Pace:
    """Sizes a paced sequence's share of a step (``scheduler.py``) by feedback from measured
    steps: ``decode_s`` is the median of the last ``DECODE_WINDOW`` steps that only decode
    (a median, not a mean: one step stalled by the machine's load would raise a mean for
    many steps, and every share sized against it). After a step that ran paced tokens
    beside decodes, its extra length (in decode steps) is remembered for its size (a moving
    average, ``EXTRA_WEIGHT`` on the newest); the share moves one size down if that size's
    extra is above ``PACE_HIGH``, one size up if it is below ``PACE_LOW`` and the size above
    is not known to be too long. A forward has a fixed cost per sequence as well as one per
    token, so no per-token rate predicts the share; the feedback finds it for the model, the
    context length and the machine's load. The memory is what keeps the share from
    alternating: where the per-token cost dominates, doubling the share about doubles the
    extra, so the size below the band and the size above it can both exist, and a share
    that moved on the last step alone would spend half the steps at the long one. A size
    known to be too long is tried again every ``PROBE_STEPS`` paced steps (the machine's
    load changes). Steps with nothing else running (pacing held after the others left)
    leave the share as it is."""

    def __init__(self) -> None:
        self._decodes: deque[float] = deque(maxlen=DECODE_WINDOW)
        self._extra: dict[int, float] = {}
        self._since_probe = 0
        self.size = PACED_FIRST

    @property
    def decode_s(self) -> float | None:
        return statistics.median(self._decodes) if self._decodes else None

    def tokens(self, budget: int) -> int:
        return max(1, min(PACED_SIZES[self.size], budget))

    def observe(self, seconds: float, decodes: int, paced: int, other_prefill: int) -> None:
        """One step's length, and what it ran: decoding rows, paced tokens, other prefill
        tokens (a step with other prefill tells nothing about either)."""
        if other_prefill or not decodes:
            return
        if not paced:
            self._decodes.append(seconds)
            return
        decode_s = self.decode_s
        if decode_s is None:
            return
        extra = seconds / decode_s - 1
        seen = self._extra.get(self.size)
        extra = extra if seen is None else EXTRA_WEIGHT * extra + (1 - EXTRA_WEIGHT) * seen
        self._extra[self.size] = extra
        self._since_probe += 1
        if extra > PACE_HIGH:
            self.size = max(0, self.size - 1)
        elif extra < PACE_LOW and self.size + 1 < len(PACED_SIZES):
            above = self._extra.get(self.size + 1)
            if above is None or above <= PACE_HIGH or self._since_probe >= PROBE_STEPS:
                self.size += 1
                self._since_probe = 0


class _Host(Protocol):
    tokenizer: Any
    runner: ModelRunner
    allocator: SlotAllocator


class Stepper:
    def __init__(self, host: _Host, step_tokens: int | None = None) -> None:
        self.host = host
        self.step_tokens = step_tokens or step_tokens_for(host.runner.device.type)
        self.running: list[Sequence] = []
        self._lock = threading.RLock()
        self._ops = 0
        self._ops_cond = threading.Condition()
        self._work = threading.Condition()  # new sequences (wakes an idle step thread)
        self._progress = threading.Condition()  # a step ended (wakes the owners)
        self._thread: threading.Thread | None = None
        self._owner: int | None = None  # the thread inside ``exclusive()``, if any
        self._depth = 0
        self.pace = Pace()
        self.steps = 0
        self._shared_at = float("-inf")  # when a step last ran another session's sequence
        self._stopped = 0  # sequences that stopped stepping in the last step
        self._halt: BaseException | None = None  # ``halt``: every sequence fails with it

    def halt(self, error: BaseException) -> None:
        """Fail every sequence with ``error`` before its next step (module doc); any thread."""
        self._halt = error
        with self._work:
            self._work.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine lock, for work between steps."""
        with self._ops_cond:
            self._ops += 1
            self._ops_cond.notify_all()  # a step loop handing off (``HANDOFF_S``) goes on
        try:
            with self._lock:
                self._owner, self._depth = threading.get_ident(), self._depth + 1
                try:
                    yield
                finally:
                    self._depth -= 1
                    if not self._depth:
                        self._owner = None
        finally:
            with self._ops_cond:
                self._ops -= 1
                self._ops_cond.notify_all()

    def holds_lock(self) -> bool:
        """Whether the calling thread is inside ``exclusive()`` (then no step can run until
        it leaves, and work that needs the step loop must run inline)."""
        return self._owner == threading.get_ident()

    def prefill(
        self, prefix: Match, prefix_ids: list[int], token_ids: list[int], namespace: Namespace
    ) -> list[int]:
        """Forward ``token_ids`` after ``prefix`` (its rows ``prefix.slots``, of the tokens
        ``prefix_ids``) as a sequence of the step loop; the fresh slots now holding their KV,
        the caller's to keep or free. Call outside the lock, with the prefix rows held. If it
        fails, nothing is left allocated and the error is raised."""
        if self.holds_lock():
            raise RuntimeError("Stepper.prefill: called inside exclusive() (no step could run)")
        if not token_ids:
            return []
        params = SamplingParams(max_tokens=0)
        seq = Sequence(
            prompt_ids=prefix_ids + token_ids, params=params, namespace=namespace, match=prefix,
            sampler=Sampler(params, self.host.runner.device), detok=Detokenizer(self.host.tokenizer),
            stop_ids=frozenset(), t0=time.perf_counter(), paced=True,
        )  # fmt: skip
        with self.exclusive():
            self.running.append(seq)
        try:
            self.drive(seq)
        except BaseException:
            with self.exclusive():
                if seq in self.running:
                    self.running.remove(seq)
                self.host.allocator.free(seq.fresh + seq.reserved)
                seq.fresh, seq.reserved = [], []
            raise
        return seq.fresh

    # ------------------------------------------------------------------ driving
    def drive(self, seq: Sequence) -> None:
        """Wait until ``seq`` stops stepping, delivering its tokens on this thread. Raises
        what ``on_token`` raised, or what the step raised (the sequence is then no longer
        running)."""
        self._start()
        while True:
            self._drain(seq)
            if not seq.stepping:
                self._drain(seq)
                if seq.error is not None:
                    raise seq.error
                return
            with self._progress:
                while seq.stepping and not seq.events:
                    self._progress.wait()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="leyline-step", daemon=True)
                self._thread.start()
        with self._work:
            self._work.notify_all()

    def _loop(self) -> None:
        idle_since: float | None = None
        while True:
            with self._ops_cond:
                while self._ops:
                    self._ops_cond.wait()
            ran = False
            with self._lock:
                if self.running and self._halt is not None:
                    for s in list(self.running):
                        s.error = copy.copy(self._halt)  # one per raising thread
                        self._finish(s)
                    ran = True
                elif self.running:
                    try:
                        ran = self.step()
                    except BaseException as e:  # every running sequence's owner raises it
                        for s in list(self.running):
                            s.error = e
                            self._finish(s)
                        ran = True
                elif idle_since is not None and time.monotonic() - idle_since > IDLE_S:
                    self._thread = None
                    return
            if ran:
                idle_since = None
                stopped, self._stopped = self._stopped, 0
                with self._progress:
                    self._progress.notify_all()
                if stopped:  # their owners commit before the next step (``HANDOFF_S``)
                    with self._ops_cond:
                        self._ops_cond.wait_for(lambda: self._ops > 0, timeout=HANDOFF_S)
                continue
            idle_since = idle_since if idle_since is not None else time.monotonic()
            with self._work:  # a sequence arriving after this check notifies the wait
                if not self.running:
                    self._work.wait(IDLE_S / 10)

    def step(self) -> bool:
        """One forward over every running sequence (call under the lock); False if there
        was nothing to run."""
        t0 = time.perf_counter()
        if any(not s.paced for s in self.running if s.stepping):
            self._shared_at = t0
        pacing = t0 - self._shared_at < PACE_HOLD_S
        plan = schedule(
            self.running, self.step_tokens, self.pace.tokens(self.step_tokens) if pacing else None
        )
        if not plan:
            return False
        decodes = paced = other = 0
        for p in plan:
            if p.seq.status is not SeqStatus.PREFILL:
                decodes += 1
            elif p.seq.paced:
                paced += p.num_tokens
            else:
                other += p.num_tokens
        inputs: list[StepInput] = []
        new: list[list[int]] = []
        ahead: list[list[int]] = []  # decode rows allocated with a prompt's last chunk
        runner, alloc = self.host.runner, self.host.allocator
        try:
            for p in plan:
                s = p.seq
                start = s.num_computed
                toks = s.token_ids[start : start + p.num_tokens]
                prefill = s.status is SeqStatus.PREFILL
                last_chunk = prefill and start + p.num_tokens == len(s.prompt_ids)
                wants = s.status is SeqStatus.DECODE or (last_chunk and s.params.max_tokens > 0)
                if not prefill:
                    fresh, more = self._decode_row(s), []
                else:  # a prefill chunk; the prompt's last one brings its first decode block
                    block = min(DECODE_BLOCK, s.params.max_tokens) if wants else 0
                    rows = alloc.alloc(p.num_tokens + block)
                    fresh, more = rows[: p.num_tokens], rows[p.num_tokens :]
                new.append(fresh)
                ahead.append(more)
                inputs.append(StepInput(toks, s.slots + fresh, wants))
            logits = runner.run(inputs)
        except BaseException:
            for f in new + ahead:
                alloc.free(f)
            raise
        self.steps += 1
        if logits is not None:  # the grammar masks of the rows sampled below, in one batch
            wanting = zip(plan, inputs, strict=True)
            mask_batch(logits, [p.seq.sampler for p, i in wanting if i.want_logits])
        k = 0
        for p, fresh, more, inp in zip(plan, new, ahead, inputs, strict=True):
            s = p.seq
            s.fresh += fresh
            if more:
                s.reserved = more[::-1]
            if s.status is SeqStatus.FLUSH:
                self._finish(s)
            elif s.params.max_tokens == 0 and s.num_computed == len(s.prompt_ids):
                s.ttft_s = s.e2e_s = time.perf_counter() - s.t0
                self._finish(s)
            elif inp.want_logits:
                assert logits is not None
                self._sample(s, logits[k])
                k += 1
        self.pace.observe(time.perf_counter() - t0, decodes, paced, other)
        return True

    # ------------------------------------------------------------------ helpers
    def _sample(self, s: Sequence, logits: Any) -> None:
        tok = s.sampler.choose(logits)
        if not s.output_ids:
            s.ttft_s = time.perf_counter() - s.t0
        s.status = SeqStatus.DECODE
        s.output_ids.append(tok)
        if s.logprobs is not None:
            s.logprobs.append(s.sampler.logprob(logits, tok, self.host.tokenizer))
        delta = s.detok.push(tok)
        done = tok in s.stop_ids or s.detok.stopped
        last = len(s.output_ids) >= s.params.max_tokens
        if done or last:
            delta += s.detok.flush()
            s.finish_reason = "stop" if done else "length"
            s.e2e_s = time.perf_counter() - s.t0
            s.status = SeqStatus.FLUSH if s.meta.get("flush") else SeqStatus.FINISHED
            if s.status is SeqStatus.FINISHED:
                self._finish(s)
        s.events.append((tok, delta))

    def _decode_row(self, s: Sequence) -> list[int]:
        if not s.reserved:  # rows still to write: the outputs to come, and the last one's
            left = s.params.max_tokens - len(s.output_ids) + 1
            s.reserved = self.host.allocator.alloc(max(1, min(DECODE_BLOCK, left)))[::-1]
        return [s.reserved.pop()]

    def _finish(self, s: Sequence) -> None:
        self.host.allocator.free(s.reserved)
        s.reserved = []
        s.status = SeqStatus.FINISHED
        self._stopped += 1
        if s in self.running:
            self.running.remove(s)

    def _drain(self, seq: Sequence) -> None:
        while seq.events:
            tok, delta = seq.events.popleft()
            if seq.on_token is not None:
                seq.on_token(tok, delta)
