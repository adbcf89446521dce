"""Ground truth for serving tests: plain Hugging Face forwards, no Leyline code involved.

``hf_greedy`` re-runs the whole sequence through ``AutoModelForCausalLM`` at every step
(no cache of any kind), so it is independent of the engine's prefix cache, KV pool and
splices. Use it for what a fresh prefill defines: plain requests and FORGET.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["Greedy", "hf_greedy", "hf_model"]


@dataclass(frozen=True, slots=True)
class Greedy:
    token_ids: list[int]  # up to and including a stop token, if one came
    logprobs: list[float]  # of each chosen token
    top: list[list[tuple[int, float]]]  # the k best (id, logprob) at each step
    stopped: bool


@cache
def hf_model(path: str | Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def hf_greedy(
    path: str | Path,
    prompt_ids: Sequence[int],
    max_tokens: int,
    stop_ids: Sequence[int] = (),
    top_k: int = 0,
) -> Greedy:
    """Greedy continuation of ``prompt_ids`` by full recomputation at every step."""
    import torch

    model = hf_model(str(path))
    ids, out, lps, tops = list(prompt_ids), [], [], []
    stopped = False
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            tok = int(torch.argmax(lp))
            out.append(tok)
            lps.append(float(lp[tok]))
            if top_k:
                vals, idx = torch.topk(lp, top_k)
                tops.append([(int(i), float(v)) for v, i in zip(vals, idx, strict=True)])
            if tok in stop_ids:
                stopped = True
                break
    return Greedy(out, lps, tops, stopped)
