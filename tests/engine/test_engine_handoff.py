"""A finished sequence's owner commits between two steps, not after the next one.

While another request keeps the step loop busy decoding, a short request (one sampled
token) needs two steps: its prefill-and-sample step and the step that writes its token's row
(``SeqStatus.FLUSH``). With the hand-off (``stepper.HANDOFF_S``) its owner commits right after
that and ``generate`` returns. Without it (``HANDOFF_S = 0``) the step loop has already started
the next step when the owner asks for the lock, and the answer waits for that step too: 3.
Both are measured here, on the same engine, so the test fails if the hand-off stops working.
"""

from __future__ import annotations

import statistics
import threading

import pytest

from leyline_agent.engine import stepper
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine, SamplingParams
from leyline_agent.testing.token_ids import random_ids


@pytest.fixture(scope="module")
def eng():
    return Engine.from_pretrained(tiny_model_dir("llama"))


def _steps_per_short_request(eng: Engine, n: int, seed: int) -> list[int]:
    stop = threading.Event()

    def busy() -> None:  # long answers back to back: the loop never stops stepping
        k = 0
        while not stop.is_set():
            k += 1
            eng.generate(random_ids(seed * 1000 + k, 50), SamplingParams(max_tokens=300))

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        while eng.stepper.steps < 3:  # the loop is running chunks
            threading.Event().wait(0.01)
        out = []
        for k in range(n):
            before = eng.stepper.steps
            eng.generate(random_ids(seed * 1000 + 500 + k, 20), SamplingParams(max_tokens=1))
            out.append(eng.stepper.steps - before)
    finally:
        stop.set()
        t.join()
    return out


def test_the_owner_commits_before_the_next_step(eng, monkeypatch):
    handed = _steps_per_short_request(eng, 7, 1)
    monkeypatch.setattr(stepper, "HANDOFF_S", 0.0)
    waited = _steps_per_short_request(eng, 7, 2)
    print("steps per short request: hand-off", handed, "without", waited)
    assert statistics.median(handed) <= 2
    assert statistics.median(waited) >= statistics.median(handed) + 1
