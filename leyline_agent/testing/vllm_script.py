"""``vllm serve`` answering a script: the real engine, with only the sampled tokens chosen.

    LEYLINE_VLLM_SCRIPT='["<tool_call>...</tool_call>", "All done."]' \\
        vllm serve MODEL --logits-processors leyline_agent.testing.vllm_script:ScriptedLogits

The vLLM counterpart of ``scripted_engine.ScriptedEngine`` (a random-weight model never writes
a tool call, so an agent's tool loop cannot run on it): a logits processor (vLLM's
``LogitsProcessor`` interface, loaded by ``--logits-processors`` in the engine's process)
that leaves one token possible at each step, the next of the scripted turn, then the chat
format's end of turn (``<|im_end|>``). Everything else is vLLM's: its renderer, chat
template, tool parser, Responses API, prefix cache. The turn played is chosen as
``ScriptedEngine`` chooses it: by the number of assistant turns already in the prompt (past
the script's end the last turn repeats); a prompt that already opens the answer gets the
rest of the turn (``scripted_engine.forced_rest``). With ``LEYLINE_VLLM_SCRIPT_PROMPTS``
naming a file, every prompt is appended to it as decoded text (one JSON string a line), as
``ScriptedEngine.prompts`` records them. Imports torch and vLLM: the vLLM venv only.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from leyline_agent.testing.scripted_engine import ASSISTANT_TURN, END, forced_rest

__all__ = ["PROMPTS_ENV", "SCRIPT_ENV", "ScriptedLogits"]

SCRIPT_ENV = "LEYLINE_VLLM_SCRIPT"  # a JSON list of the turns' texts
PROMPTS_ENV = "LEYLINE_VLLM_SCRIPT_PROMPTS"  # optional: a file the prompts are appended to


class ScriptedLogits(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        from transformers import AutoTokenizer

        self.script = [str(t) for t in json.loads(os.environ[SCRIPT_ENV])]
        if not self.script:
            raise ValueError(f"{SCRIPT_ENV}: needs at least one turn")
        self.tok = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        self.end = self.tok.convert_tokens_to_ids(END)
        self.prompts = os.environ.get(PROMPTS_ENV)
        # batch index -> (the answer's tokens, the request's running output tokens)
        self.rows: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token: greedy requests too

    def _answer(self, prompt: list[int] | None) -> list[int]:
        decoded = self.tok.decode(prompt or [])
        if self.prompts:
            with open(self.prompts, "a", encoding="utf-8") as f:
                f.write(json.dumps(decoded) + "\n")
        turn = decoded.count(ASSISTANT_TURN) - 1  # the generation prompt is one
        text = forced_rest(self.script[min(max(turn, 0), len(self.script) - 1)], decoded)
        return self.tok.encode(text, add_special_tokens=False) + [self.end]

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, _params, prompt, output in batch_update.added:
            self.rows[index] = (self._answer(prompt), output)
        for a, b, how in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if row_b is not None and how.name == "SWAP":
                self.rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (answer, output) in self.rows.items():
            token = answer[min(len(output), len(answer) - 1)]
            logits[index] = float("-inf")
            logits[index, token] = 0.0
        return logits
