"""The loop of ``leyline eval mini-nightmare``: plan episodes, skip finished ones, run the
rest one at a time under a progress bar, write the reports (also when stopped early).

Each arm (of each run) starts from an empty server cache: the harness calls
``POST /leyline/v1/flush`` before its first episode, so an arm's hit rate does not depend
on which arms ran before it (an endpoint without the route is warned about).
``max_steps`` counts the agent's actions (debug-gym's own ``max_steps`` counts the reset
as a step: ``run_episode`` passes ``max_steps + 1``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import structlog

from leyline_agent.errors import LeylineError, RuntimeUnavailableError

from .dataset import resolve_tasks
from .endpoint import Endpoint
from .eval_config import EvalConfig, load_eval_config, resolve_arms
from .eval_report import markdown, write_reports
from .nightmare import EpisodeStore, load_tasks, run_episode

__all__ = ["add_arguments", "main", "run_eval"]

log = structlog.get_logger(__name__)


MODELS_DIR = Path(".leyline/models")  # where `leyline make-model` puts the README's models


def _tokenizer_dir(model: str, tokenizer: str | None, endpoint: Endpoint) -> str:
    """``--tokenizer``; else the model's folder: ``--model`` itself, the path the endpoint
    reports as the model's ``root`` (vLLM does), or ``.leyline/models/<model>``."""
    if tokenizer:
        candidates = [Path(tokenizer)]
    else:
        root = endpoint.model_root(model)
        candidates = [Path(model), *([Path(root)] if root else []), MODELS_DIR / model]
    for path in candidates:
        if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
            return str(path)
    tried = ", ".join(repr(str(p)) for p in candidates)
    raise LeylineError(
        "--tokenizer: debug-gym's HuggingFaceLLM counts tokens with a local Hugging Face "
        f"tokenizer; give its folder (the model folder works); none found in {tried}"
    )


def run_eval(
    *,
    base_url: str,
    model: str,
    arms: str,
    tasks: str,
    runs: int,
    out: Path,
    config: EvalConfig,
    max_steps: int | None = None,
    tokenizer: str | None = None,
    data_dir: Path | None = None,
    context_limit_k: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every missing (task, arm, run) episode; return the summary of all of them."""
    if runs < 1:
        raise LeylineError(f"--runs: must be >= 1, got {runs}")
    if max_steps is not None and max_steps < 1:
        raise LeylineError(f"--max-steps: must be >= 1, got {max_steps}")
    arm_names = resolve_arms(arms, config)
    task_names = resolve_tasks(tasks)
    endpoint = Endpoint(base_url)
    endpoint.check_model(model)
    tok = _tokenizer_dir(model, tokenizer, endpoint)

    out.mkdir(parents=True, exist_ok=True)
    store = EpisodeStore(out / "episodes.jsonl")
    finished = store.finished()
    (out / "run_config.json").write_text(
        json.dumps(
            {
                "base_url": base_url,
                "model": model,
                "tokenizer": tok,
                "arms": arm_names,
                "tasks": task_names,
                "runs": runs,
                "max_steps": max_steps,
                "config": config.model_dump(mode="json"),
            },
            indent=2,
            default=str,
        )
    )
    dataset = load_tasks(data_dir or out / "mini_nightmare", task_names)
    plan = [(t, a, r) for r in range(runs) for a in arm_names for t in task_names]
    todo = [p for p in plan if p not in finished]

    from tqdm import tqdm

    bar = tqdm(
        total=len(plan),
        initial=len(plan) - len(todo),
        desc="mini-nightmare",
        unit="ep",
        disable=not progress,
    )
    block: tuple[str, int] | None = None
    try:
        for task, arm, run in todo:
            bar.set_postfix_str(f"{task}/{arm}/r{run}")
            if (arm, run) != block:  # each arm starts from an empty cache
                block = (arm, run)
                flushed = endpoint.flush()
                if flushed is None:
                    log.warning(
                        "the endpoint has no /leyline/v1/flush: its cache carries over "
                        "between arms, so hit rates depend on the arm order",
                        base_url=base_url,
                    )
                else:
                    log.info("cache flushed", arm=arm, run=run, **flushed)
            record = run_episode(
                task,
                arm,
                run,
                task_data=dataset[task],
                config=config,
                endpoint=endpoint,
                model=model,
                tokenizer=tok,
                out=out,
                max_steps=max_steps,
                context_limit_k=context_limit_k,
            )
            store.append(record)
            log.info("episode", **record.model_dump(exclude={"splices"}))
            bar.update(1)
    except RuntimeUnavailableError as e:
        done = len(store.records())
        raise RuntimeUnavailableError(
            f"{e} -- stopped; {done} finished episode(s) kept in {store.path} "
            "(rerun the same command to continue)"
        ) from e
    finally:
        bar.close()
        records = [r for r in store.records() if r.arm in arm_names and r.task in task_names]
        summary = write_reports(records, out, arm_names)
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url",
        required=True,
        help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:30000/v1",
    )
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local HF tokenizer folder for debug-gym's token counting (default: --model if "
        "a folder, else the endpoint's model root, else .leyline/models/MODEL)",
    )
    p.add_argument(
        "--arms",
        default="baseline,stale-tool,stale-tool+failed-call,history-cutoff",
        help="comma list of arms (configs/runs/eval.yaml); each starts from an empty cache",
    )
    p.add_argument("--tasks", default="all", help="all or a comma list")
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="most actions (LLM calls) per episode (default: the config's agent.max_steps, "
        "debug-gym's 50, which counts the reset as a step: 49 actions)",
    )
    p.add_argument("--runs", type=int, default=1, help="runs of every (task, arm)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/mini-nightmare"),
        help="output folder (reruns resume)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML over the defaults (configs/runs/eval.yaml; debug-gym's own config works)",
    )
    p.add_argument("--task-timeout", type=float, default=None, help="seconds per episode")
    p.add_argument("--max-tokens", type=int, default=None, help="generation length per step")
    p.add_argument(
        "--context-limit-k", type=int, default=None, help="context window, thousands of tokens"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    """``leyline eval mini-nightmare``: the run, then its table and where its files are."""
    over: dict = {}
    if args.task_timeout is not None:
        over["task_timeout_s"] = args.task_timeout
    if args.max_tokens is not None:
        over["generate"] = {"max_tokens": args.max_tokens}
    config = load_eval_config(args.config, **over)
    summary = run_eval(
        base_url=args.base_url,
        model=args.model,
        arms=args.arms,
        tasks=args.tasks,
        runs=args.runs,
        out=args.out,
        config=config,
        max_steps=args.max_steps,
        tokenizer=args.tokenizer,
        context_limit_k=args.context_limit_k,
        progress=not args.no_progress,
    )
    print(markdown(summary))
    print(
        f"episodes: {args.out / 'episodes.jsonl'}  summary: {args.out / 'summary.json'}  "
        f"plot: {args.out / 'summary.png'}"
    )
    return 0
