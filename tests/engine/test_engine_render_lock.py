"""``Engine.render`` runs beside the step loop: while another thread holds the engine lock
(a step, a splice's plan), a render finishes, and its ids equal the chat template's text
encoded by the shared tokenizer (each thread renders with its own copy)."""

from __future__ import annotations

import threading

import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine

MESSAGES = [{"role": "user", "content": "<think>" * 2000 + " Hello there."}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(tiny_model_dir("llama"))


def test_render_does_not_wait_for_the_engine_lock(engine: Engine) -> None:
    engine.render([{"role": "user", "content": "warm"}])  # this thread's tokenizer copy
    held, rendered, seen = threading.Event(), threading.Event(), []

    def hold() -> None:  # holds the lock until the render is done, or 10 s
        with engine.stepper.exclusive():
            held.set()
            seen.append(rendered.wait(10))

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    out = engine.render(MESSAGES)
    rendered.set()
    holder.join(30)
    assert seen == [True]  # the render ended while the other thread still held the lock
    text = engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert out == engine.tokenizer.encode(text, add_special_tokens=False)
