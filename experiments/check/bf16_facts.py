"""``leyline check bf16``: what bf16 does to a splice on a real model (docs/exactness.md).

On the real agent conversations of ``quality_data`` (stale output stubbed, a question ``Q``),
with the model in bf16 and in fp32, in-process engines:

- logits error against fp32 truth, rel-L2 = ||bf16 - fp32|| / ||fp32|| over the vocabulary:
  the bf16 splice (``T`` cached, AMORTIZE, ``logits_for(T' + Q)``) against the fp32 splice
  truth (``RefState``: the model's own modules and rotary function), and a plain bf16
  prefill of ``T' + Q`` against a plain fp32 forward (the error bf16 costs without a splice);
- key drift of chained splices (``correctness.drift``: the tail's cached keys after k
  AMORTIZE splices against their float64 rotation), at k = 1, 4, 16;
- cache-state dependence: the same request (``T' + Q``, one greedy token with its logprob)
  sent twice to one engine after the splice: the first call prefills ``Q`` over the cached
  ``T'``, the second finds ``T' + Q`` cached but its last token and prefills one token. In
  fp32 the two logprobs agree to rounding; in bf16 they need not. Also a plain prompt
  (no splice) sent twice.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: leyline fetch-model smollm2)")
    p.add_argument("--prompts", type=int, default=8, help="conversations measured")
    p.add_argument("--out", type=Path, default=Path("runs/bf16"), help="output folder")


def _twice(engine: Any, prompt: list[int]) -> tuple[float, float]:
    """The greedy first token's logprob of ``prompt``, asked twice in a row."""
    from leyline_agent.engine.params import SamplingParams

    p = SamplingParams(max_tokens=1, logprobs=True)
    a = engine.generate(prompt, p).logprobs[0].logprob
    b = engine.generate(prompt, p).logprobs[0].logprob
    return a, b


def _measure(model_dir: Path, n: int) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from leyline_agent.engine.engine import Engine, SamplingParams
    from leyline_agent.namespaces import DEFAULT_TENANT
    from leyline_agent.reference.kv_reference import RefState, logits_from_kv
    from leyline_agent.wire import DirectivesRequest

    from .correctness import rel_l2
    from .quality import build_cases
    from .quality_data import load_conversations

    tok = AutoTokenizer.from_pretrained(model_dir)
    convs = [c for c in load_conversations() if c["kind"] == "general"][:n]
    cases = build_cases(tok, convs, ["stub"])
    f32 = Engine.from_pretrained(model_dir, dtype="float32")
    b16 = Engine.from_pretrained(model_dir, dtype="bfloat16")
    rows = []
    for case in cases:
        d = {"start": case.start, "end": case.end, "replacement": case.replacement, "mode": "amortize"}
        prompt = case.edited + case.question
        with torch.inference_mode():
            truth = logits_from_kv(f32.model, RefState.prefill(f32.model, case.tokens)
                                   .amortize(case.start, case.end, case.replacement).kv(), case.question)  # fmt: skip
            plain32 = f32.model(input_ids=torch.tensor([prompt])).logits[0, -1]
        row: dict[str, Any] = {"case": case.id, "tokens": len(prompt)}
        for name, eng in (("float32", f32), ("bfloat16", b16)):
            eng.cache.flush(DEFAULT_TENANT)  # every case starts from an empty cache
            fresh = eng.logits_for(prompt)  # nothing of T' + Q cached yet: a plain prefill
            eng.generate(case.tokens, SamplingParams(max_tokens=0))
            eng.apply_directives(DirectivesRequest(tokens=case.tokens, directives=[d]))
            spliced = eng.logits_for(prompt)
            a, b = _twice(eng, prompt)
            row[name] = {"splice_vs_truth": rel_l2(spliced, truth), "plain_vs_fp32": rel_l2(fresh, plain32),
                         "twice": [a, b]}  # fmt: skip
        rows.append(row)
    return {"rows": rows}


def _fmt(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.1e} (max {max(xs):.1e})"


def main(args: argparse.Namespace) -> int:
    from leyline_agent.engine.checkpoints.fetch import smollm2_dir

    from .correctness import drift

    model = Path(args.model) if args.model else smollm2_dir()
    rep = _measure(model, args.prompts)
    rows = rep["rows"]
    print(f"check bf16: {model.name}, {len(rows)} conversations (stale output stubbed, AMORTIZE), "
          f"{min(r['tokens'] for r in rows)}-{max(r['tokens'] for r in rows)} tokens")  # fmt: skip
    print("")
    print("| logits rel-L2 against fp32 truth | float32 engine | bfloat16 engine |")
    print("|---|---|---|")
    for key, label in (("splice_vs_truth", "spliced (AMORTIZE) vs the fp32 splice truth"),
                       ("plain_vs_fp32", "plain prefill vs a plain fp32 forward")):  # fmt: skip
        print(f"| {label} | {_fmt([r['float32'][key] for r in rows])} | "
              f"{_fmt([r['bfloat16'][key] for r in rows])} |")  # fmt: skip
    print("")
    for dt in ("float32", "bfloat16"):
        gaps = [abs(r[dt]["twice"][0] - r[dt]["twice"][1]) for r in rows]
        print(f"{dt}: the same spliced request twice in a row (T' + Q, then T' + Q again): "
              f"|Δ logprob of the greedy token| mean {statistics.fmean(gaps):.2e}, "
              f"max {max(gaps):.2e}, {sum(g > 0 for g in gaps)}/{len(gaps)} differ")  # fmt: skip
    curve = drift(model, max_chain=16)["curve"]
    print("")
    print("| chained splices (bf16 cache) | 1 | 4 | 16 |")
    print("|---|---|---|---|")
    for key, label in (("fp32_rotation", "key drift, fp32 rotation (the engine)"),
                       ("bf16_rotation", "key drift, rotation computed in bf16")):  # fmt: skip
        print(f"| {label} | " + " | ".join(f"{curve[k - 1][key]:.1e}" for k in (1, 4, 16)) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bf16.json").write_text(json.dumps({**rep, "drift": curve}, indent=1))
    return 0
