"""REPAIR's selector and budget ablation on a real model (SmolLM2), in process.

For each conversation (``data/quality_conversations.json``: a stale tool output stubbed, then
a question) and each arm, the embedded engine's cache is put in the arm's state and the
question is scored on it:

    FULL      the unedited history, prefilled fresh
    FORGET    the edited history, prefilled fresh
    AMORTIZE  T prefilled, the edit spliced by a directive (mode amortize)
    REPAIR    T prefilled, the edit spliced by mode repair at a budget (a fraction of the
              tail), with a selector: ngram / ngram-first / first / match / match-first (the engine's own,
              ``directives.repair``), deviation (CacheBlend: the tail rows whose layer-1 K/V
              moved most under the edited context) and ngram+deviation (bigram rows, then by
              deviation); the last two recompute the rows the experiment picks through
              ``engine.repair.repair_rows``, the engine's own code

Metrics: first-token argmax agreement with FORGET and with FULL; mean |delta| of the log
probability of FORGET's top-1 token against FORGET; for fact cases the teacher-forced log P
of the answer's tokens. Fact cases are the file's (``quoted_next``, ``quoted_later``,
``span_only``) plus, for every setting, the quote variant the file lacks, made from its
``span_only`` conversation by writing the quote into the same assistant turn.

    python -m leyline_agent.experiments.check.repair_ablation --model DIR --out runs/repair-ablation
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from leyline_agent.directives.repair import SELECTORS as ENGINE_SELECTOR_NAMES
from leyline_agent.directives.repair import RepairSpan, ngram_rows, rows_for
from leyline_agent.engine.engine import Engine, SamplingParams
from leyline_agent.engine.repair import repair_rows
from leyline_agent.namespaces import DEFAULT_TENANT, Namespace
from leyline_agent.wire import DirectivesRequest

DATA = Path(__file__).resolve().parents[1] / "data" / "quality_conversations.json"
BUDGETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
ENGINE_SELECTORS = tuple(ENGINE_SELECTOR_NAMES)
SELECTORS = (*ENGINE_SELECTORS, "deviation", "ngram+deviation")


def cases(path: Path) -> list[dict[str, Any]]:
    """The file's conversations, plus the missing quote variant of every fact."""
    convs = json.loads(path.read_text())
    out = list(convs)
    have = {(c["answer"], c["kind"]) for c in convs if c["kind"] != "general"}
    for c in convs:
        if c["kind"] != "span_only":
            continue
        name = c["question"].split("value of ")[1].split(" ")[0]
        quote = f"Noted: {name} is {c['answer']}."
        for kind, at in (("quoted_next", 1), ("quoted_later", 3)):
            if (c["answer"], kind) in have:
                continue
            msgs = [dict(m) for m in c["messages"]]
            i = c["stale"] + at
            text = msgs[i]["content"]
            cut = text.find(" I'll run")
            msgs[i]["content"] = quote + (text[cut:] if cut >= 0 else "")
            out.append({**c, "id": c["id"].replace("span_only", kind) + "+", "kind": kind,
                        "messages": msgs})  # fmt: skip
    return out


def tokenize(eng: Engine, c: dict[str, Any]) -> dict[str, Any]:
    msgs = c["messages"]
    edited = [dict(m) for m in msgs]
    edited[c["stale"]]["content"] = c["stub"]
    T = eng.render(msgs, add_generation_prompt=False)
    Tp = eng.render(edited, add_generation_prompt=False)
    full = eng.render([*msgs, {"role": "user", "content": c["question"]}])
    assert full[: len(T)] == T, "the question's render does not extend the history"
    s = 0
    while T[s] == Tp[s]:
        s += 1
    k = 0
    while k < min(len(T), len(Tp)) - s and T[-1 - k] == Tp[-1 - k]:
        k += 1
    target = eng.tokenizer.encode(c.get("answer", ""), add_special_tokens=False)
    return {"T": T, "Tp": Tp, "start": s, "end": len(T) - k, "R": Tp[s : len(Tp) - k],
            "Q": full[len(T):], "target": target}  # fmt: skip


def score(eng: Engine, slots: list[int], q: Sequence[int], target: Sequence[int]) -> dict:
    """First-token log-probabilities after ``q`` and the answer's teacher-forced log P.
    (Not under ``inference_mode``: a pool that grows here must grow as ordinary tensors,
    which later splices write in place; the runner's forward is in inference mode itself.)"""
    runner, fresh = eng.runner, []
    try:
        rows, logits = runner.prefill(slots, list(q))
        fresh += rows
        first = torch.log_softmax(logits.float(), -1)
        lp, ctx, cur = 0.0, slots + rows, first
        for t in target:
            lp += float(cur[t])
            rows, logits = runner.prefill(ctx, [t])
            fresh += rows
            ctx = ctx + rows
            cur = torch.log_softmax(logits.float(), -1)
    finally:
        eng.allocator.free(fresh)
    return {"first": first, "target_lp": lp}


def deviation_order(eng: Engine, amort: list[int], exact: list[int], lo: int) -> list[int]:
    """Tail rows (from ``lo``) by how far their layer-1 K/V moved (CacheBlend), largest first.
    Layer 1's K/V under the edited context is the fresh prefill's: layer 0 reads only token
    and position, so recomputing layer 0 over the tail (CacheBlend's pass) gives it exactly."""
    a = eng.pool.as_cache_data(amort[lo:])[1]
    b = eng.pool.as_cache_data(exact[lo:])[1]
    d = sum((x - y).float().pow(2).sum(dim=(0, 1, 3)) for x, y in zip(a, b, strict=True))
    return [lo + int(i) for i in torch.argsort(d, descending=True)]


def run_case(
    eng: Engine, c: dict[str, Any], k: int, selectors: Sequence[str], budgets: Sequence[float]
) -> dict[str, dict[str, float]]:
    tk = tokenize(eng, c)
    T, Tp, s, e, R, Q, tgt = (tk[x] for x in ("T", "Tp", "start", "end", "R", "Q", "target"))
    lo = s + len(R)
    out: dict[str, dict] = {}
    with eng.stepper.exclusive():
        full_rows, _ = eng.runner.prefill([], T, want_logits=False)
        exact_rows, _ = eng.runner.prefill([], Tp, want_logits=False)
        out["FULL"] = score(eng, full_rows, Q, tgt)
        out["FORGET"] = score(eng, exact_rows, Q, tgt)
    eng.generate(T, SamplingParams(max_tokens=0))
    arms: list[tuple[str, str, float]] = [("AMORTIZE", "amortize", 0.0)]
    arms += [(f"REPAIR/{sel}/{b:g}", sel, b) for sel in selectors for b in budgets]
    order: list[int] | None = None
    for j, (name, sel, budget) in enumerate(arms):
        ns = Namespace(DEFAULT_TENANT, f"c{k}-a{j}")
        own = sel in ENGINE_SELECTORS
        d = {"start": s, "end": e, "replacement": R, "mode": "repair" if own else "amortize"}
        if own:
            d["budget"] = budget
            eng.repair_selector = sel
        with eng.stepper.exclusive():  # inline: no step loop in between (one caller)
            req = DirectivesRequest(tokens=T, directives=[d])
            resp = eng.apply_directives(req, namespace=ns)
            assert resp.tokens == Tp
            m = eng.cache.match(Tp, ns)
            assert m.length == len(Tp)
            if not own and sel != "amortize":
                if order is None:
                    order = deviation_order(eng, m.slots, exact_rows, lo)
                n = rows_for(budget, len(Tp) - lo)
                span = RepairSpan(lo, len(Tp), tuple(T[s:e]), budget)
                first = ngram_rows(Tp, span)[:n] if sel == "ngram+deviation" else []
                rows = list(dict.fromkeys(first + order))[:n]
                repair_rows(eng.runner, Tp, m.slots, sorted(rows), m.slots[lo:],
                            eng.stepper.exclusive)  # fmt: skip
            out[name] = score(eng, m.slots, Q, tgt)
            out[name]["rows"] = resp.repaired_tokens or (
                rows_for(budget, len(Tp) - lo) if sel != "amortize" else 0
            )
    with eng.stepper.exclusive():
        eng.allocator.free(full_rows + exact_rows)
    ref = out["FORGET"]["first"]
    top = int(torch.argmax(ref))
    res = {}
    for name, o in out.items():
        f = o["first"]
        res[name] = {
            "argmax_forget": float(int(torch.argmax(f)) == top),
            "argmax_full": float(int(torch.argmax(f)) == int(torch.argmax(out["FULL"]["first"]))),
            "dlp_forget": abs(float(f[top]) - float(ref[top])),
            "target_lp": o["target_lp"],
            "tail": len(Tp) - lo,
            "rows": o.get("rows", 0),
        }
    return res


def summarize(per_case: dict[str, dict], kinds: dict[str, str]) -> dict[str, dict]:
    """Per arm: general (argmax agreement, mean |dlp|), quoted (within 0.5 nats of FORGET or
    above, mean gap), span_only (no higher than FORGET + 0.5)."""
    arms = next(iter(per_case.values())).keys()
    out = {}
    for a in arms:
        gen = [r[a] for cid, r in per_case.items() if kinds[cid] == "general"]
        quo = [(r[a], r["FORGET"]) for cid, r in per_case.items() if kinds[cid].startswith("quoted")]
        spo = [(r[a], r["FORGET"]) for cid, r in per_case.items() if kinds[cid] == "span_only"]
        out[a] = {
            "general_n": len(gen),
            "argmax_forget": sum(g["argmax_forget"] for g in gen),
            "argmax_full": sum(g["argmax_full"] for g in gen),
            "mean_dlp_forget": sum(g["dlp_forget"] for g in gen) / max(1, len(gen)),
            "quoted_n": len(quo),
            "quoted_ok": sum(x["target_lp"] >= f["target_lp"] - 0.5 for x, f in quo),
            "quoted_worst_gap": min((x["target_lp"] - f["target_lp"] for x, f in quo), default=0),
            "span_n": len(spo),
            "span_ok": sum(x["target_lp"] <= f["target_lp"] + 0.5 for x, f in spo),
            "rows_share": sum(r[a]["rows"] / r[a]["tail"] for r in per_case.values())
            / len(per_case),
        }
    return out


def table(summary: dict[str, dict]) -> str:
    lines = [
        "| arm | rows / tail | argmax = FORGET (general) | argmax = FULL | mean abs dlp vs FORGET "
        "| quoted within 0.5 of FORGET | worst quoted gap | span-only <= FORGET + 0.5 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a, s in summary.items():
        lines.append(
            f"| {a} | {100 * s['rows_share']:.1f} % | {s['argmax_forget']:g}/{s['general_n']} "
            f"| {s['argmax_full']:g}/{s['general_n']} | {s['mean_dlp_forget']:.4f} "
            f"| {s['quoted_ok']}/{s['quoted_n']} | {s['quoted_worst_gap']:+.2f} "
            f"| {s['span_ok']}/{s['span_n']} |"
        )
    return "\n".join(lines)


def plot(
    summary: dict[str, dict], path: Path, selectors: Sequence[str], budgets: Sequence[float]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for sel in selectors:
        xs = list(budgets)
        ks = [f"REPAIR/{sel}/{b:g}" for b in budgets]
        ax1.plot(xs, [summary[k]["quoted_ok"] / max(1, summary[k]["quoted_n"]) for k in ks], "o-", label=sel)
        ax2.plot(xs, [summary[k]["mean_dlp_forget"] for k in ks], "o-", label=sel)
    am = summary["AMORTIZE"]
    ax1.axhline(am["quoted_ok"] / max(1, am["quoted_n"]), color="grey", ls="--", label="AMORTIZE")
    ax2.axhline(am["mean_dlp_forget"], color="grey", ls="--", label="AMORTIZE")
    ax1.set(xscale="log", xlabel="budget (fraction of the tail)",
            ylabel="quoted facts within 0.5 nats of FORGET")  # fmt: skip
    ax2.set(xscale="log", xlabel="budget (fraction of the tail)",
            ylabel="mean |delta top-1 logprob| vs FORGET (general)")  # fmt: skip
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--out", type=Path, default=Path("runs/repair-ablation"))
    p.add_argument("--general", type=int, default=30, help="general conversations used")
    p.add_argument("--no-facts", dest="facts", action="store_false", help="general ones only")
    p.add_argument("--selectors", default=",".join(SELECTORS))
    p.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    selectors = a.selectors.split(",")
    budgets = [float(b) for b in a.budgets.split(",")]
    eng = Engine.from_pretrained(a.model, cache_budget_tokens=32768, pin_ttl_s=0)
    every = cases(a.data)  # fact cases first, then the general ones
    convs = [c for c in every if c["kind"] != "general"] if a.facts else []
    convs += [c for c in every if c["kind"] == "general"][: a.general]
    t0 = time.perf_counter()
    started, load_before = dt.datetime.now(dt.UTC), os.getloadavg()
    per_case: dict[str, dict] = {}
    kinds = {c["id"]: c["kind"] for c in convs}
    a.out.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(["python -m leyline_agent.experiments.check.repair_ablation", *(argv or [])])
    for k, c in enumerate(convs):
        per_case[c["id"]] = run_case(eng, c, k, selectors, budgets)
        print(f"{k + 1}/{len(convs)} {c['id']} {time.perf_counter() - t0:.0f} s", flush=True)
        # written after every case: a partial run counts, and says how far it got
        (a.out / CASES).write_text(json.dumps(
            {"command": cmd, "cases_done": k + 1, "cases": len(convs), "per_case": per_case,
             "kinds": kinds, "selectors": selectors, "budgets": budgets}, indent=1))  # fmt: skip
    finish(a.out, started, load_before)


CASES = "cases.json"


def finish(out: Path, started: Any, load_before: Any) -> None:
    """The table and plot from ``out/cases.json``, recorded as a run (``report.json``,
    rendered into docs/results.md by ``leyline bench report``)."""
    from ..reports.results import write_record

    rec = json.loads((out / CASES).read_text())
    summary = summarize(rec["per_case"], rec["kinds"])
    plot(summary, out / "quality_vs_budget.png", rec["selectors"], rec["budgets"])
    text = (f"{rec['cases_done']} of {rec['cases']} conversations "
            f"({', '.join(sorted(set(rec['kinds'].values())))})\n\n{table(summary)}\n"
            f"plot: {out / 'quality_vs_budget.png'}\n")  # fmt: skip
    print(text)
    write_record(out, "check repair-ablation", rec["command"], started, load_before, text)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
