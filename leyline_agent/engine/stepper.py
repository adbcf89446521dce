"""The engine's step loop: schedule -> run one batch -> post-process, shared by threads.

``Stepper`` holds the running sequences. A thread that generates (``Engine.generate``) adds
its sequence, then repeats: under the engine lock, run one step for *all* running
sequences (whoever holds the lock drives; the others' tokens wait in their ``events``);
outside the lock, hand its own sequence's new tokens to its ``on_token``. When the sequence
has finished stepping, its owner commits it (cache insert, counters) or, if ``on_token``
raised (a client left), aborts it: its rows are freed and nothing is cached or counted.
So callbacks run on the owner's thread and never inside a step, and everything else that
touches the engine (directives, stats, render) takes the same lock: it runs between steps.

``exclusive()`` is that lock, fair to non-step work: a waiting operation makes drivers
pause after their current step.

Slots: a prefill chunk gets one allocation (a run of slots). A decoding sequence takes its
rows from a block of up to ``DECODE_BLOCK`` slots allocated ahead (``Sequence.reserved``;
what is left is freed when it finishes): with one allocation per token, the rows of eight
sequences decoding side by side would interleave, and attention, which reads a sequence's
rows run by run as views of the pool, would have to gather them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.model.runner import ModelRunner, StepInput
from leyline_agent.engine.scheduler import DEFAULT_STEP_TOKENS, schedule
from leyline_agent.engine.sequence import SeqStatus, Sequence

__all__ = ["DECODE_BLOCK", "Stepper"]

DECODE_BLOCK = 128


class _Host(Protocol):
    tokenizer: Any
    runner: ModelRunner
    allocator: SlotAllocator


class Stepper:
    def __init__(self, host: _Host, step_tokens: int = DEFAULT_STEP_TOKENS) -> None:
        self.host, self.step_tokens = host, step_tokens
        self.running: list[Sequence] = []
        self._lock = threading.RLock()
        self._ops = 0
        self._ops_cond = threading.Condition()
        self.steps = 0

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine lock, for work between steps."""
        with self._ops_cond:
            self._ops += 1
        try:
            with self._lock:
                yield
        finally:
            with self._ops_cond:
                self._ops -= 1
                self._ops_cond.notify_all()

    # ------------------------------------------------------------------ driving
    def drive(self, seq: Sequence) -> None:
        """Step until ``seq`` stops stepping, delivering its tokens on this thread.
        Raises what ``on_token`` raised (the sequence is then no longer running)."""
        while True:
            self._drain(seq)
            if not seq.stepping:
                self._drain(seq)
                return
            with self._ops_cond:
                while self._ops:
                    self._ops_cond.wait()
            with self._lock:
                if seq.stepping and not seq.events:
                    self.step()

    def step(self) -> None:
        """One forward over every running sequence (call under the lock)."""
        plan = schedule(self.running, self.step_tokens)
        if not plan:
            return
        inputs: list[StepInput] = []
        new: list[list[int]] = []
        runner, alloc = self.host.runner, self.host.allocator
        try:
            for p in plan:
                s = p.seq
                start = s.num_computed
                toks = s.token_ids[start : start + p.num_tokens]
                prefill = s.status is SeqStatus.PREFILL
                fresh = alloc.alloc(p.num_tokens) if prefill else self._decode_row(s)
                new.append(fresh)
                wants = s.status is SeqStatus.DECODE or (
                    s.status is SeqStatus.PREFILL
                    and start + p.num_tokens == len(s.prompt_ids)
                    and s.params.max_tokens > 0
                )
                inputs.append(StepInput(toks, s.slots + fresh, wants))
            logits = runner.run(inputs)
        except BaseException:
            for f in new:
                alloc.free(f)
            raise
        self.steps += 1
        k = 0
        for p, fresh, inp in zip(plan, new, inputs, strict=True):
            s = p.seq
            s.fresh += fresh
            if s.status is SeqStatus.FLUSH:
                self._finish(s)
            elif s.params.max_tokens == 0 and s.num_computed == len(s.prompt_ids):
                s.ttft_s = s.e2e_s = time.perf_counter() - s.t0
                self._finish(s)
            elif inp.want_logits:
                assert logits is not None
                self._sample(s, logits[k])
                k += 1

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
        if s in self.running:
            self.running.remove(s)

    def _drain(self, seq: Sequence) -> None:
        while seq.events:
            tok, delta = seq.events.popleft()
            if seq.on_token is not None:
                seq.on_token(tok, delta)
