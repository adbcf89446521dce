"""A served engine that answers a script: the real engine, with only the answer replaced.

    engine = ScriptedEngine(Engine.from_pretrained(tiny_model_dir("deepseek_v2")),
                            [tool_call("read_file", {"path": "a.py"}), "All done."])
    with serve_in_thread(create_app(engine, client_edits="amortize")) as srv: ...

A random-weight tiny model never writes a tool call, so an agent framework's tool loop cannot
run on it. Everything else is the real engine: tokenizer, chat template, radix cache,
directives, splices, counters and ``/leyline/v1/stats``. The turn played is chosen by the
number of assistant turns already in the prompt (so concurrent conversations each replay the
script from its start; past its end the last turn repeats). The scripted answer is prefilled
after the prompt by the real engine (``generate(prompt + answer)``), so the cache holds what a
capable model would have left there. ``prompts`` records every prompt's token ids. A prompt
that already opens the answer (``tool_choice: "required"`` makes the server append
``<tool_call>\\n``) gets the rest of the scripted turn, as a model would write it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

from leyline_agent.engine.params import GenerationResult, SamplingParams

__all__ = ["ScriptedEngine", "tool_call"]

ASSISTANT_TURN = "<|im_start|>assistant"
END = "<|im_end|>"


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The answer text of a model calling ``name`` (the tiny models' ``<tool_call>`` format)."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def forced_rest(text: str, prompt: str) -> str:
    """What the model still writes of ``text`` when the prompt already opens its answer (the
    server's ``tool_choice`` prefix, e.g. ``<tool_call>\\n`` after the generation prompt)."""
    opened = prompt.rsplit(ASSISTANT_TURN, 1)[-1].removeprefix("\n")
    return text.removeprefix(opened) if opened and text.startswith(opened) else text


class ScriptedEngine:
    def __init__(self, engine: Any, script: Sequence[str]) -> None:
        if not script:
            raise ValueError("script: needs at least one turn")
        self.engine = engine
        self.script = list(script)
        self.model_name = engine.model_name
        self.prompts: list[list[int]] = []
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def __getattr__(self, name: str) -> Any:  # render, apply_directives, stats, counters, ...
        return getattr(self.engine, name)

    def generate(self, prompt_ids, params, on_token=None, *, namespace=None) -> GenerationResult:
        tok = self.tokenizer
        prompt = list(prompt_ids)
        with self._lock:
            self.prompts.append(prompt)
        decoded = tok.decode(prompt)
        turn = decoded.count(ASSISTANT_TURN) - 1  # the generation prompt is one
        text = forced_rest(self.script[min(max(turn, 0), len(self.script) - 1)], decoded)
        answer = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids(END)]
        kw = {} if namespace is None else {"namespace": namespace}
        real = self.engine.generate(prompt + answer, SamplingParams(max_tokens=0), **kw)
        for k, t in enumerate(answer):
            if on_token is not None:
                on_token(t, tok.decode(answer[: k + 1]) if k == 0 else "")
        return GenerationResult(
            prompt_ids=prompt, output_ids=answer, text=text, finish_reason="stop",
            prompt_tokens=len(prompt), cached_tokens=min(real.cached_tokens, len(prompt)),
            prefilled_tokens=len(prompt) - min(real.cached_tokens, len(prompt)),
            logprobs=None, ttft_s=real.ttft_s, e2e_s=real.e2e_s,
        )  # fmt: skip
