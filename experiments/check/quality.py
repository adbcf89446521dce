"""``leyline check quality``: does a spliced cache answer like the unedited or the re-prefilled one?

On real agent conversations (``quality_data``: real command output, one stale tool output
stubbed, or deleted, then a new question), every arm of ``quality_arms`` serves the question
through a real ``leyline serve`` (one per dtype, started here) and the report compares them:

- first-token agreement: the greedy first answer token of two arms is the same;
- |Δ top-1 logprob|: the logprob the first arm gives its own first token, minus what the
  second arm gives that token (read from its top 20; a token outside them counts at the
  20th logprob, a lower bound of the gap, and is counted in ``outside``);
- greedy answers: the two arms' greedy answers (``--greedy`` tokens, 32, or up to the stop
  token) are equal;
- closer to FULL: for each edited arm but FORGET, in how many cases its first-token gap to
  FULL is smaller than its gap to FORGET;
- fact recall: on the fact cases, the teacher-forced log P of the number (the sum over its
  digit tokens) after a question that asks for it, by where the number is: quoted by a later
  assistant turn (right after the stub, or two turns later) or only inside the stubbed span.
  ``argmax`` counts the cases where every digit was the arm's top token.

``--quick`` is the demo's form: ``QUICK``'s fixed subset, fp32, stub only, greedy 8, and
``--share-prefix`` (one flush per case, ``run_arms``): the splices start from FULL's prefill
instead of prefilling ``T`` again, and FORGET prefills only from the edit on.
Per-case results go to ``<out>/cases-<dtype>.jsonl``; the printed tables are the record.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..replay.replay_counts import common_prefix
from .correctness import edit_spans
from .quality_arms import ARMS, Arm, Case, Completion, QualityServer
from .quality_data import load_conversations

__all__ = ["QUICK", "ArmResult", "build_cases", "main", "quick_caption", "run_arms"]

REFERENCES = ("FULL", "FORGET")
FACT_KINDS = ("quoted_next", "quoted_later", "span_only")
_DONE = {"stub": "stubbed", "delete": "deleted"}


@dataclass(frozen=True, slots=True)
class ArmResult:
    case: str
    kind: str
    variant: str
    arm: str
    first: Completion
    target_logprob: float | None  # fact cases: log P(number | question)
    target_argmax: bool | None
    target_outside: int  # digits outside the top 20 (their logprob is a bound)


# -- cases ---------------------------------------------------------------------------------


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _render(tok: Any, msgs: list[dict[str, Any]], gen: bool = False) -> str:
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def build_cases(tok: Any, convs: list[dict[str, Any]], variants: list[str]) -> list[Case]:
    """Token-level cases from the conversations, rendered with the model's chat template."""
    cases = []
    for conv in convs:
        msgs, k = conv["messages"], conv["stale"]
        text = _render(tok, msgs)
        tokens = _ids(tok, text)
        q_text = _render(tok, [*msgs, {"role": "user", "content": conv["question"]}], gen=True)
        q_text += conv.get("answer_prefix", "")  # a fact's answer starts "NAME = "
        question = _ids(tok, q_text[len(text) :])
        if _ids(tok, q_text) != tokens + question:
            raise ValueError(f"{conv['id']}: the question does not tokenize apart from the history")
        for variant in variants:
            if variant == "stub":
                edited = [*msgs[:k], {**msgs[k], "content": conv["stub"]}, *msgs[k + 1 :]]
            elif variant == "delete":
                edited = [*msgs[:k], *msgs[k + 1 :]]
            else:
                raise ValueError(f"unknown variant {variant!r} (stub, delete)")
            start, end, repl = edit_spans(tokens, _ids(tok, _render(tok, edited)))
            target = _ids(tok, conv["answer"]) if "answer" in conv else []
            cases.append(Case(conv["id"], conv["kind"], variant, tokens, start, end, repl,
                              question, target))  # fmt: skip
    return cases


# -- running -------------------------------------------------------------------------------


def _lookup(top: dict[str, float], text: str) -> tuple[float, bool]:
    """``text``'s logprob in a top-20 dict, or the 20th logprob (a bound) when it is not there."""
    if text in top:
        return top[text], True
    return min(top.values()), False


def _run_case(server: QualityServer, arm: Arm, case: Case, tok: Any, greedy: int,
              exact: list[list[int]]) -> ArmResult:  # fmt: skip
    history = arm.history(server, case)
    prompt = history + case.question
    first = server.complete(prompt, greedy)
    _check_cache(arm, case, prompt, first.cached, exact)
    if arm.splice:  # T prefilled, then R over T[:start]: both exact rows (the tail is the session's)
        exact += [case.tokens, case.edited[: case.start + len(case.replacement)]]
    else:
        exact.append(prompt)
    total, argmax, outside = None, None, 0
    if case.target:
        total, argmax = 0.0, True
        for i, t in enumerate(case.target):
            top = first.top[0] if i == 0 else server.complete(prompt + case.target[:i], 1).top[0]
            text = tok.decode([t])
            lp, found = _lookup(top, text)
            total += lp
            outside += not found
            argmax = argmax and found and lp >= max(top.values())
    return ArmResult(case.id, case.kind, case.variant, arm.name, first, total, argmax, outside)


def _check_cache(
    arm: Arm, case: Case, prompt: list[int], cached: int, exact: list[list[int]]
) -> None:
    """A splice arm's answer reads ``T'`` from the cache; a prefill arm reads only rows that
    an exact prefill since the last flush shares with it (never another arm's splice)."""
    if arm.splice and cached < len(case.edited):
        raise RuntimeError(f"{arm.name} on {case.id}: {cached} prompt tokens from the cache, "
                           f"fewer than T' ({len(case.edited)}): the answer did not read the splice")  # fmt: skip
    allowed = max((common_prefix(prompt, p) for p in exact), default=0)
    if not arm.splice and cached > allowed:
        raise RuntimeError(f"{arm.name} on {case.id}: {cached} prompt tokens from the cache, but "
                           f"exact prefills since the flush share only {allowed} with it")  # fmt: skip


def run_arms(server: QualityServer, arms: list[Arm], cases: list[Case], tok: Any, greedy: int,
             log: Path | None = None, share_prefix: bool = False) -> list[ArmResult]:  # fmt: skip
    """Every arm on every case, arms interleaved case by case, each arm in its own session.

    Without ``share_prefix`` the cache is flushed before every arm: each starts cold. With
    it, once per case, and the arms run unedited first, then the splices, then the other
    edited arms: a splice starts from the history an unedited arm prefilled (as after the
    turn that produced it), and a re-prefill of the edited history reuses the exact rows
    before the edit (as FORGET does in the engine) but never a splice's rows (checked on
    every answer's ``cached_tokens``, ``_check_cache``)."""
    out, unedited = [], {}
    order = sorted(arms, key=lambda a: a.edited and not a.splice) if share_prefix else arms
    with open(log, "w", buffering=1) if log else open("/dev/null", "w") as f:  # noqa: SIM115
        for case in cases:
            exact: list[list[int]] = []  # prompts prefilled since the last flush
            if share_prefix:
                server.flush()
            for arm in order:
                if not arm.edited and (case.id, arm.name) in unedited:
                    r = replace(unedited[(case.id, arm.name)], variant=case.variant)
                else:
                    if not share_prefix:
                        server.flush()
                        exact = []
                    r = _run_case(server.session(arm.name.lower()), arm, case, tok,
                                  greedy if case.kind == "general" else 1, exact)  # fmt: skip
                    unedited[(case.id, arm.name)] = r
                f.write(json.dumps(asdict(r)) + "\n")
                out.append(r)
    return out


# -- report --------------------------------------------------------------------------------


def _gap(a: ArmResult, b: ArmResult) -> tuple[float, bool]:
    """|a's top-1 logprob - b's logprob of a's top-1 token| at the first answer token."""
    t = a.first.tokens[0]
    lp, found = _lookup(b.first.top[0], t)
    return abs(a.first.logprobs[0] - lp), found


def _pairs_table(by: dict[tuple[str, str, str], ArmResult], keys: list[tuple[str, str]],
                 names: list[str]) -> list[str]:  # fmt: skip
    n = len(keys)
    lines = [
        "| pair | first token equal | mean abs Δ top-1 logprob | max | outside top-20 | greedy answers equal |",
        "|---|---|---|---|---|---|",
    ]
    for a, b in itertools.combinations(names, 2):
        ra = [by[(c, v, a)] for c, v in keys]
        rb = [by[(c, v, b)] for c, v in keys]
        same = sum(x.first.tokens[0] == y.first.tokens[0] for x, y in zip(ra, rb, strict=True))
        gaps = [_gap(x, y) for x, y in zip(ra, rb, strict=True)]
        eq = sum(x.first.tokens == y.first.tokens for x, y in zip(ra, rb, strict=True))
        g = [d for d, _ in gaps]
        lines.append(f"| {a} / {b} | {same}/{n} | {statistics.fmean(g):.4f} | {max(g):.4f} | "
                     f"{sum(not f for _, f in gaps)} | {eq}/{n} |")  # fmt: skip
    closer = [x for x in names if x not in REFERENCES]
    if all(r in names for r in REFERENCES) and closer:
        lines.append("")
        for x in closer:
            k = sum(
                _gap(by[(c, v, "FULL")], by[(c, v, x)])[0] < _gap(by[(c, v, "FORGET")], by[(c, v, x)])[0]
                for c, v in keys
            )
            lines.append(f"{x}'s first token closer to FULL's than to FORGET's: {k}/{n}")
    return lines


def _facts_table(by: dict[tuple[str, str, str], ArmResult], keys: list[tuple[str, str]],
                 kinds: dict[str, str], names: list[str]) -> list[str]:  # fmt: skip
    lines = ["| number is | cases | " + " | ".join(f"{a} log P / argmax" for a in names) + " |",
             "|---|---|" + "---|" * len(names)]  # fmt: skip
    for kind in FACT_KINDS:
        ks = [(c, v) for c, v in keys if kinds[c] == kind]
        if not ks:
            continue
        cells = []
        for a in names:
            rs = [by[(c, v, a)] for c, v in ks]
            mean = statistics.fmean(r.target_logprob for r in rs)
            cells.append(f"{mean:.2f} / {sum(bool(r.target_argmax) for r in rs)}")
        label = {"quoted_next": "quoted right after the edited output",
                 "quoted_later": "quoted two turns later",
                 "span_only": f"only in the {_DONE[ks[0][1]]} output"}[kind]  # fmt: skip
        lines.append(f"| {label} | {len(ks)} | " + " | ".join(cells) + " |")
    return lines


def report(results: list[ArmResult], names: list[str], dtype: str) -> list[str]:
    """The tables of one dtype: per variant, the pairs on general cases and the fact recall."""
    by = {(r.case, r.variant, r.arm): r for r in results}
    kinds = {r.case: r.kind for r in results}
    lines = []
    for variant in dict.fromkeys(r.variant for r in results):
        general = list(dict.fromkeys((r.case, r.variant) for r in results
                                     if r.variant == variant and r.kind == "general"))  # fmt: skip
        facts = list(dict.fromkeys((r.case, r.variant) for r in results
                                   if r.variant == variant and r.kind != "general"))  # fmt: skip
        if general:
            lines += ["", f"{dtype}, stale output {_DONE[variant]}: {len(general)} conversations", ""]
            lines += _pairs_table(by, general, names)
        if facts:
            lines += ["", f"{dtype}, stale output {_DONE[variant]}: fact recall, {len(facts)} cases "
                      "(mean teacher-forced log P of the number / cases with every digit the top token)", ""]  # fmt: skip
            lines += _facts_table(by, facts, kinds, names)
    return lines


# -- command -------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: leyline fetch-model smollm2)")
    p.add_argument("--dtypes", default=None,
                   help="comma list: float32, bfloat16 (default: both; --quick: float32)")  # fmt: skip
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--variants", default="stub,delete", help="comma list: stub, delete")
    p.add_argument("--greedy", type=int, default=32, help="greedy answer length compared")
    p.add_argument("--quick", action="store_true",
                   help="the demo's form: QUICK's conversations and fact cases, stub only, greedy 8, "
                        "fp32, --share-prefix")  # fmt: skip
    p.add_argument("--share-prefix", action="store_true",
                   help="flush once per case, not per arm: splices start from the unedited arm's "
                        "prefill and re-prefills reuse the exact rows before the edit")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("runs/quality"), help="output folder")


# The quick form's fixed subset: every stale command (ls, cat, git log, grep, pytest) and
# every question of the general set, and two fact cases of each kind.
QUICK = ("general-00", "general-01", "general-02", "general-03", "general-04", "general-05",
         "general-06", "general-19", "fact-max_retries-quoted_next", "fact-page_size-quoted_next",
         "fact-timeout_s-quoted_later", "fact-port-quoted_later", "fact-max_retries-span_only",
         "fact-timeout_s-span_only")  # fmt: skip


def select_conversations(convs: list[dict[str, Any]], quick: bool) -> list[dict[str, Any]]:
    if not quick:
        return convs
    by_id = {c["id"]: c for c in convs}
    return [by_id[i] for i in QUICK]


def quick_caption() -> str:
    """The quick form's subset, named in its table's caption."""
    general = [i.removeprefix("general-") for i in QUICK if i.startswith("general-")]
    facts = [i.removeprefix("fact-") for i in QUICK if i.startswith("fact-")]
    return (
        f"quick subset of check quality's set: conversations general-{{{','.join(general)}}} "
        f"(every stale command and question kind); fact cases {', '.join(facts)}"
    )


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from leyline_agent.engine.checkpoints.fetch import smollm2_dir

    from ..bench.side_by_side import leyline_serve

    model = Path(args.model) if args.model else smollm2_dir()
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}")
    arms = [ARMS[a] for a in args.arms.split(",")]
    names = [a.name for a in arms]
    dtypes = (args.dtypes or ("float32" if args.quick else "float32,bfloat16")).split(",")
    variants = ["stub"] if args.quick else args.variants.split(",")
    greedy = min(args.greedy, 8) if args.quick else args.greedy
    tok = AutoTokenizer.from_pretrained(model)
    convs = select_conversations(load_conversations(), args.quick)
    cases = build_cases(tok, convs, variants)
    args.out.mkdir(parents=True, exist_ok=True)
    n_gen = sum(c["kind"] == "general" for c in convs)
    share = args.share_prefix or args.quick
    print(f"check quality: {model.name}, {n_gen} conversations + {len(convs) - n_gen} fact cases, "
          f"variants {', '.join(variants)}, arms {', '.join(names)}, greedy {greedy}"
          f"{', prefixes shared' if share else ''}")  # fmt: skip
    if args.quick:
        print(quick_caption())
    for dtype in dtypes:
        t0 = time.monotonic()
        with leyline_serve(model, "--dtype", dtype) as url:
            server = QualityServer(url, model.name)
            try:
                results = run_arms(server, arms, cases, tok, greedy,
                                   log=args.out / f"cases-{dtype}.jsonl", share_prefix=share)  # fmt: skip
            finally:
                server.close()
        print("\n".join(report(results, names, dtype)))
        print(f"\n({dtype}: {time.monotonic() - t0:.0f} s)")
    return 0
