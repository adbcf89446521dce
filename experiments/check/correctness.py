"""``leyline check correctness``: what a splice changes in what the model says.

Over N prompts (agent trajectories rendered with the model's chat template) and one edit
each (the oldest tool result replaced by a stub, as StaleToolTruncation would), the
first-token argmax after the next user turn ``Q``:

- full context: a plain forward of ``T' + Q`` (Hugging Face, no cache of any kind);
- splice: ``T`` cached in the engine, AMORTIZE directive, ``engine.logits_for(T' + Q)``;
- re-prefill: ``T`` cached, no directive, ``engine.logits_for(T' + Q)`` (the prefix cache
  reuses ``T[:start]`` and prefills the rest: what a radix cache does after an edit);
- splice ground truth: ``RefState`` (``leyline_agent.reference.kv_reference``), AMORTIZE
  built from the model's own modules and RoPE, never from ``rotate_band``.

splice vs ground truth must agree exactly (fp32); splice vs full context measures the
approximation AMORTIZE makes (the tail keeps values computed over the old span).

Drift (bf16; MLA: the k_pe band, GQA: the whole post-RoPE keys): k = 1..K chained AMORTIZE
splices on a bf16 engine, each moving the tail by a small delta; the tail's cached rotary
band against the float64 rotation of
the band as first stored by the cumulative delta: rel-L2 = ||band - exact|| / ||exact||.
"fp32 rotation" is the engine (rotate_band, fp32 math); "bf16 rotation" applies the same
deltas to the stored band with cos/sin and products in bf16 (what a rotation written in the
cache dtype would do). Writes ``correctness.json`` and ``correctness.png``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from leyline_agent.errors import LeylineError

from ..replay.trajectories import DEFAULT_SET, load_trajectories

__all__ = ["add_arguments", "agreement", "drift", "edit_spans", "main", "rel_l2"]

STUB = "[stale output elided]"
_MAX_CHARS = 600  # message contents are cut to this, to keep CPU prompts short


def edit_spans(old: list[int], new: list[int]) -> tuple[int, int, list[int]]:
    """The edit ``old[start:end] -> replacement`` that makes ``new`` (common prefix and suffix kept)."""
    s = 0
    while s < min(len(old), len(new)) and old[s] == new[s]:
        s += 1
    t = 0
    while t < min(len(old), len(new)) - s and old[-1 - t] == new[-1 - t]:
        t += 1
    return s, len(old) - t, new[s : len(new) - t]


def _prompts(engine: Any, n: int, max_tokens: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(T, T') token pairs: trajectory prefixes with their oldest tool result stubbed."""
    rng = random.Random(seed)
    out = []
    trajs = load_trajectories(DEFAULT_SET)
    for k in range(n * 4):
        traj = trajs[k % len(trajs)]
        msgs = traj.messages
        tools = [i for i, m in enumerate(msgs) if m.get("role") == "tool"]
        if len(tools) < 2:
            continue
        end = rng.choice(tools[1:4]) + 1
        first = next(i for i in tools if i < end)
        old = [{**m, "content": (m.get("content") or "")[:_MAX_CHARS]} for m in msgs[:end]]
        new = [dict(m) for m in old]
        new[first]["content"] = STUB
        T = engine.render(old, add_generation_prompt=False)
        Tn = engine.render(new, add_generation_prompt=False)
        if len(T) > max_tokens or T == Tn:
            continue
        out.append((T, Tn))
        if len(out) == n:
            break
    if not out:
        raise LeylineError(f"no prompt of at most {max_tokens} tokens in {DEFAULT_SET}")
    return out


def agreement(model_dir: Path, n: int, max_tokens: int = 2048, seed: int = 0) -> dict[str, Any]:
    import torch

    from leyline_agent.engine.engine import Engine, SamplingParams
    from leyline_agent.reference.kv_reference import RefState, logits_from_kv
    from leyline_agent.wire import DirectivesRequest

    probe = Engine.from_pretrained(model_dir)
    model = probe.model
    Q = probe.render([{"role": "user", "content": "Continue."}], add_generation_prompt=True)
    rows = []
    for T, Tn in _prompts(probe, n, max_tokens, seed):
        s, e, R = edit_spans(T, Tn)
        with torch.inference_mode():
            full = model(input_ids=torch.tensor([Tn + Q])).logits[0, -1].float()
        spl = Engine(model, probe.tokenizer)
        spl.generate(T, SamplingParams(max_tokens=0))
        spl.apply_directives(
            DirectivesRequest(
                tokens=T, directives=[{"start": s, "end": e, "replacement": R, "mode": "amortize"}]
            )
        )
        splice = spl.logits_for(Tn + Q).float()
        rep = Engine(model, probe.tokenizer)
        rep.generate(T, SamplingParams(max_tokens=0))
        reprefill = rep.logits_for(Tn + Q).float()
        truth = logits_from_kv(model, RefState.prefill(model, T).amortize(s, e, R).kv(), Q)
        a = {
            k: int(v.argmax())
            for k, v in (
                ("full", full),
                ("splice", splice),
                ("reprefill", reprefill),
                ("truth", truth),
            )
        }
        rows.append(
            {
                "tokens": len(T),
                "start": s,
                "end": e,
                "replacement": len(R),
                "argmax": a,
                "splice_vs_truth_max_abs": float((splice - truth).abs().max()),
                "reprefill_vs_full_max_abs": float((reprefill - full).abs().max()),
                "splice_vs_full_max_abs": float((splice - full).abs().max()),
            }
        )

    def frac(x: str, y: str) -> float:
        return sum(r["argmax"][x] == r["argmax"][y] for r in rows) / len(rows)

    return {
        "prompts": len(rows),
        "splice_vs_full": frac("splice", "full"),
        "reprefill_vs_full": frac("reprefill", "full"),
        "splice_vs_truth": frac("splice", "truth"),
        "splice_vs_truth_max_abs": max(r["splice_vs_truth_max_abs"] for r in rows),
        "rows": rows,
    }


def _exact_rotation(band: Any, delta: int, inv_freq: Any, layout: str) -> Any:
    """float64 rotation of ``band`` [..., 2h] by ``delta`` positions (pairs per layout)."""
    import torch

    x = band.to(torch.float64)
    h = inv_freq.numel()
    a, b = (x[..., 0::2], x[..., 1::2]) if layout == "interleaved" else (x[..., :h], x[..., h:])
    ang = delta * inv_freq.to(torch.float64)
    c, s = ang.cos(), ang.sin()
    na, nb = a * c - b * s, b * c + a * s
    if layout == "interleaved":
        return torch.stack((na, nb), dim=-1).flatten(-2)
    return torch.cat((na, nb), dim=-1)


def _bf16_rotation(band: Any, delta: int, inv_freq: Any, layout: str) -> Any:
    import torch

    h = inv_freq.numel()
    ang = delta * inv_freq.float()
    c, s = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    a, b = (
        (band[..., 0::2], band[..., 1::2])
        if layout == "interleaved"
        else (band[..., :h], band[..., h:])
    )
    na, nb = a * c - b * s, b * c + a * s
    if layout == "interleaved":
        return torch.stack((na, nb), dim=-1).flatten(-2)
    return torch.cat((na, nb), dim=-1)


def rel_l2(x: Any, ref: Any) -> float:
    """||x - ref|| / ||ref||, in float64."""
    return float((x.double() - ref).norm() / ref.norm())


def drift(model_dir: Path, max_chain: int = 64, seed: int = 0) -> dict[str, Any]:
    import torch

    from leyline_agent.engine.engine import Engine, SamplingParams
    from leyline_agent.wire import DirectivesRequest

    eng = Engine.from_pretrained(model_dir, dtype="bfloat16")
    mla = eng.config.model_type.startswith("deepseek")
    spec = eng.rope_spec
    inv_freq, layout = spec.inv_freq_tensor().cpu(), spec.layout
    if not mla and 2 * inv_freq.numel() != eng.pool.keys.shape[-1]:
        raise LeylineError("--model: the drift report reads whole GQA keys (no partial rotary)")
    rng = random.Random(seed)
    T = _prompts(eng, 1, 2048, seed)[0][0]
    eng.generate(T, SamplingParams(max_tokens=0))
    s, width = 16, 8  # every splice rewrites T[16:24]; the tail after it is rotated
    tail = len(T) - s - width

    def band(tokens: list[int]) -> Any:
        m = eng.cache.tree.match_prefix(tokens)
        if m.length != len(tokens):
            raise LeylineError("drift: the spliced sequence is not cached")
        rows = eng.pool.as_cache_data(m.slots[-tail:])  # the tail: T's rows after the span
        if mla:  # the MLA cache's second tensor is the rotary band k_pe
            return torch.stack([v[0, 0] for _, v in rows])
        return torch.stack([k[0] for k, _ in rows])  # GQA: post-RoPE keys

    stored = band(T)
    naive = stored.clone()
    total, curve = 0, []
    for k in range(1, max_chain + 1):
        n_r = width + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if width + d >= 1])
        R = [rng.randrange(100, eng.vocab_size) for _ in range(n_r)]
        resp = eng.apply_directives(
            DirectivesRequest(
                tokens=T,
                directives=[{"start": s, "end": s + width, "replacement": R, "mode": "amortize"}],
            )
        )
        delta = n_r - width
        T, total = resp.tokens, total + delta
        width = n_r
        naive = _bf16_rotation(naive, delta, inv_freq, layout)
        exact = _exact_rotation(stored, total, inv_freq, layout)
        curve.append(
            {
                "k": k,
                "cumulative_delta": total,
                "fp32_rotation": rel_l2(band(T), exact),
                "bf16_rotation": rel_l2(naive, exact),
            }
        )
    return {"tail_tokens": int(stored.shape[1]), "layers": int(stored.shape[0]), "curve": curve}


PAPER_BF16_DRIFT = 4.7e-3  # the paper's bf16 drift of the rotated band
LOGIT_TOLERANCE = 1e-4  # what the tests hold AMORTIZE to against the independent truth


def plot(report: dict[str, Any], path: Path) -> Path:
    """Left: the largest next-token logit difference of each comparison (log scale, the
    1e-4 tolerance as a line; argmax agreement in the labels). Right: bf16 drift after k
    chained splices, with the paper's 4.7e-3 as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4))
    ag = report["agreement"]
    rows = ag.get("rows", [])
    comparisons = (
        ("splice_vs_truth", "AMORTIZE vs\nindependent truth", "tab:green"),
        ("reprefill_vs_full", "re-prefill of T'\nvs full prefill", "tab:blue"),
        ("splice_vs_full", "AMORTIZE vs full\nprefill of T' (expected to differ)", "tab:orange"),
    )
    for x, (key, _label, color) in enumerate(comparisons):
        worst = max((r[key + "_max_abs"] for r in rows), default=ag.get(key + "_max_abs", 0.0))
        worst = max(worst, 1e-12)
        a1.bar(x, worst, color=color)
        a1.text(x, worst * 1.3, f"{worst:.1e}\nargmax {ag[key]:.2f}", ha="center", fontsize=8)
    a1.set_xticks(range(3), [c[1] for c in comparisons], fontsize=8)
    a1.set_yscale("log")
    a1.set_ylim(1e-8, 10)
    a1.axhline(LOGIT_TOLERANCE, color="gray", ls="--", lw=1)
    a1.text(-0.4, LOGIT_TOLERANCE * 1.2, "test tolerance 1e-4", ha="left", fontsize=8,
            color="gray")  # fmt: skip
    a1.set_ylabel("max |next-token logit difference|")
    a1.set_title(f"splice exactness ({ag['prompts']} prompts, fp32)")
    c = report["drift"]["curve"]
    ks = [p["k"] for p in c]
    a2.plot(
        ks, [p["fp32_rotation"] for p in c], marker="o", label="fp32 rotation, bf16 store (engine)"
    )
    a2.plot(ks, [p["bf16_rotation"] for p in c], marker="s", ls="--", label="bf16 rotation (naive)")
    a2.axhline(PAPER_BF16_DRIFT, color="gray", ls=":", lw=1.2, label="paper: about 4.7e-3")
    a2.set_ylim(bottom=0)
    a2.set_xlabel("chained splices k")
    a2.set_ylabel("rel-L2 drift of the rotated band")
    a2.set_title("bf16 cache: drift after k splices")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_correctness(
    model_dir: Path, out: Path, prompts: int = 8, max_chain: int = 64
) -> dict[str, Any]:
    if not Path(model_dir).is_dir():
        raise LeylineError(f"--model: no model folder at {model_dir} (leyline make-model)")
    if prompts < 1 or max_chain < 1:
        raise LeylineError("--prompts and --max-chain must be >= 1")
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "model": str(model_dir),
        "agreement": agreement(model_dir, prompts),
        "drift": drift(model_dir, max_chain),
    }
    (out / "correctness.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "correctness.png")
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    ag, c = report["agreement"], report["drift"]["curve"]
    last = c[-1]
    return [
        f"argmax agreement over {ag['prompts']} prompts (fp32): splice vs ground truth "
        f"{ag['splice_vs_truth']:.2f} (max |logit diff| {ag['splice_vs_truth_max_abs']:.1e}), "
        f"re-prefill vs full {ag['reprefill_vs_full']:.2f}, splice vs full {ag['splice_vs_full']:.2f}",
        f"bf16 drift after {last['k']} chained splices: fp32 rotation {last['fp32_rotation']:.2e}, "
        f"bf16 rotation {last['bf16_rotation']:.2e}",
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder")
    p.add_argument("--out", type=Path, default=Path("runs/correctness"), help="output folder")
    p.add_argument("--prompts", type=int, default=8, help="prompts for the argmax agreement")
    p.add_argument("--max-chain", type=int, default=64, help="longest chain of splices (drift)")
    p.add_argument("--quick", action="store_true", help="fewer prompts and a shorter chain")


def main(args: argparse.Namespace) -> int:
    prompts = 4 if args.quick else args.prompts
    chain = min(args.max_chain, 16) if args.quick else args.max_chain
    report = run_correctness(Path(args.model), args.out, prompts, chain)
    print("\n".join(summary_lines(report)))
    print(f"report: {args.out / 'correctness.json'}  plot: {args.out / 'correctness.png'}")
    return 0
