"""``leyline eval mini-nightmare``: debug-gym's froggy agent, its LLM routed through Leyline.

One episode = one (task, arm, run): a fresh ``MiniNightmareEnv`` on a ``LocalTerminal`` (no
Docker; the dataset is provisioned offline from the installed wheel), debug-gym's agent
built by ``create_agent`` from the config, and a ``LeylineHuggingFaceLLM`` whose client is
wrapped with the arm's policies. Episodes run one at a time, so the server's counters
before and after an episode give its prompt / cached / prefilled tokens and splices.

``episodes.jsonl`` gets one line after every episode (a crash loses nothing) and a rerun
skips the (task, arm, run) already there. An endpoint that goes down stops the run with a
clear message; an episode past ``task_timeout_s`` is recorded as ``status="timeout"``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict, Field

from leyline_agent.errors import LeylineError, RuntimeUnavailableError

from .dataset import provision
from .endpoint import Endpoint, stats_delta
from .eval_config import ArmSpec, EvalConfig

__all__ = [
    "EpisodeRecord",
    "EpisodeStore",
    "EpisodeTimeout",
    "load_tasks",
    "make_env",
    "quiet_debug_gym",
    "run_episode",
]

log = structlog.get_logger(__name__)
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # debug-gym imports litellm


class EpisodeTimeout(BaseException):
    """Raised by the alarm; a BaseException so that debug-gym's handlers don't swallow it."""


class EpisodeRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    task: str
    arm: str
    run: int
    status: str = Field(description="done | timeout | error")
    solved: bool
    score: int = 0
    max_score: int | None = None
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int | None = None
    splices: dict[str, int] = Field(default_factory=dict)
    fallbacks: int | None = None
    requests: int = 0
    stats_source: str = Field(description="server (stats deltas) | client (usage blocks)")
    wall_s: float = 0.0
    error: str | None = None


class EpisodeStore:
    """``episodes.jsonl``: append-only, one JSON object per finished episode."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def records(self) -> list[EpisodeRecord]:
        if not self.path.exists():
            return []
        out = []
        for i, line in enumerate(self.path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                out.append(EpisodeRecord.model_validate_json(line))
            except ValueError as e:
                raise LeylineError(f"{self.path}:{i + 1}: not an episode record: {e}") from e
        return out

    def finished(self) -> set[tuple[str, str, int]]:
        return {(r.task, r.arm, r.run) for r in self.records()}

    def append(self, record: EpisodeRecord) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(record.model_dump_json() + "\n")
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Raise ``EpisodeTimeout`` after ``seconds`` (main thread only; elsewhere no limit)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise EpisodeTimeout

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def quiet_debug_gym() -> None:
    """debug-gym's first logger prints to the console (rich); keep it to errors."""
    from debug_gym.logger import DebugGymLogger

    if DebugGymLogger._main_process_logger is None:
        main = DebugGymLogger("leyline-eval", level=logging.ERROR)
        main.set_no_live()


def _terminal_env() -> dict[str, str]:
    """The terminal's environment: ``python`` must be this interpreter (pytest, pandas)."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return env


def load_tasks(data_dir: Path, tasks: list[str]) -> dict[str, dict[str, Any]]:
    from debug_gym.gym.envs.mini_nightmare import MiniNightmareEnv

    root = provision(data_dir)

    class _Provisioned(MiniNightmareEnv):  # only the class attribute differs
        DATA_PATH = root

    return _Provisioned.load_dataset(problems=tasks, build_image=False)


def working_copy_dir() -> Path:
    """Where every episode of this process works on its copy of the task (see below)."""
    return Path(tempfile.gettempdir()) / f"leyline-eval-{os.getpid()}" / "repo"


def _fixed_workspace(terminal: Any, logger: Any) -> Any:
    """debug-gym's ``Workspace`` on a ``LocalTerminal`` copies the task into a fresh
    ``DebugGym-<random>`` folder, and that name shows in the prompts and tool outputs: two
    episodes' prompts then differ by a few tokens, which blurs arm comparisons. This one
    reuses ``working_copy_dir()`` (emptied at every reset): the same actions give the same
    prompts in every arm. Episodes of one process run one at a time."""
    from debug_gym.gym.workspace import Workspace

    class _Fixed(Workspace):
        def cleanup(self) -> None:
            if self.working_dir is not None:
                shutil.rmtree(self.working_dir, ignore_errors=True)
            self.working_dir = None

        def reset(
            self,
            readonly_patterns: list[str] | None = None,
            ignore_patterns: list[str] | None = None,
        ) -> None:
            self.cleanup()
            path = working_copy_dir()
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            self.working_dir = path
            self.terminal.working_dir = str(path)
            self.setup_file_filters(readonly_patterns, ignore_patterns)

    return _Fixed(terminal, logger=logger)


# pytest's summary line "==== 1 failed, 2 passed in 0.75s ====" (and "in 61.2s (0:01:01)")
_PYTEST_DURATION = re.compile(r"^(=+ .*?) in \d+(?:\.\d+)?s(?: \(\d+:\d\d:\d\d\))? (=+)$", re.M)


def scrub_durations(output: str) -> str:
    """Drop the duration from pytest's summary line. debug-gym's ``cleanup_pytest_output``
    removes timings "to avoid randomizing LLM's response" but matches only unittest's
    "Ran N tests in Xs"; the wall time left in mini_nightmare's eval output made two
    episodes' prompts differ (and a greedy model's answers with them)."""
    return _PYTEST_DURATION.sub(r"\1 \2", output)


def make_env(task_data: dict[str, Any], config: EvalConfig, logger: Any) -> Any:
    from debug_gym.experiment import add_tools
    from debug_gym.gym.entities import EvalOutput
    from debug_gym.gym.envs.mini_nightmare import MiniNightmareEnv
    from debug_gym.gym.terminals.local import LocalTerminal

    class _Env(MiniNightmareEnv):  # the eval output without pytest's wall time
        def eval(self, **kwargs: Any) -> EvalOutput:
            out = super().eval(**kwargs)
            self.last_eval = EvalOutput(out.success, scrub_durations(out.output))
            return self.last_eval

    terminal = LocalTerminal(env_vars=_terminal_env(), include_os_env_vars=False, logger=logger)
    env = _Env(task_data=task_data, terminal=terminal, logger=logger, **config.env)
    env.workspace = _fixed_workspace(terminal, logger)
    add_tools(env, {"tools": config.tools}, logger)
    return env


def _make_llm(
    arm: ArmSpec,
    endpoint: Endpoint,
    model: str,
    tokenizer: str,
    config: EvalConfig,
    logger: Any,
    context_limit_k: int | None,
    session_id: str,
) -> Any:
    from leyline_agent.integrations.debug_gym import LeylineHuggingFaceLLM, make_llm_config

    policies: list[Any] = []
    runtime = None
    if arm.policies:
        from leyline_agent.agent.http_runtime import HTTPRuntime
        from leyline_agent.policies import load_policies

        policies = load_policies(list(arm.policies))
        runtime = HTTPRuntime(endpoint.root)
    llm_config = make_llm_config(
        model,
        endpoint.openai_base_url,
        tokenizer,
        context_limit_k=context_limit_k,
        generate_kwargs=config.generate,
    )
    return LeylineHuggingFaceLLM(
        model,
        llm_config,
        policies=policies,
        runtime=runtime,
        session_id=session_id,
        logger=logger,
        timeout_s=config.request_timeout_s,
    )


def run_episode(
    task: str,
    arm_name: str,
    run: int,
    *,
    task_data: dict[str, Any],
    config: EvalConfig,
    endpoint: Endpoint,
    model: str,
    tokenizer: str,
    out: Path,
    max_steps: int | None = None,
    context_limit_k: int | None = None,
) -> EpisodeRecord:
    """One episode; returns its record (``RuntimeUnavailableError`` propagates: no record).

    ``max_steps``: the most actions the agent takes (LLM calls answered by the env).
    debug-gym's ``agent.max_steps`` counts the reset as step 1 (``max_steps: 3`` gives two
    actions), so ``max_steps + 1`` is what debug-gym is given; a config's own
    ``agent.max_steps`` is passed as is, with debug-gym's meaning."""
    from debug_gym.agents.base_agent import create_agent
    from debug_gym.logger import DebugGymLogger

    quiet_debug_gym()
    arm = config.arms[arm_name]
    ep_dir = out / "episodes" / arm_name / f"{task}-r{run}"
    logger = DebugGymLogger(
        f"{task}-{arm_name}-{run}", log_dir=str(ep_dir), level=logging.ERROR, mode="w"
    )
    agent_cfg = {**config.agent, **arm.agent}
    if max_steps is not None:  # actions; debug-gym counts the reset as a step too
        agent_cfg["max_steps"] = max_steps + 1
    before = endpoint.stats()
    t0 = time.perf_counter()
    status, error, env, agent, llm = "done", None, None, None, None
    try:
        with _alarm(config.task_timeout_s):
            env = make_env(task_data, config, logger)
            llm = _make_llm(
                arm,
                endpoint,
                model,
                tokenizer,
                config,
                logger,
                context_limit_k,
                f"{task}-{arm_name}-r{run}",
            )
            agent = create_agent(agent_cfg, llm=llm, logger=logger)
            agent.run(env)
    except EpisodeTimeout:
        status, error = "timeout", f"episode exceeded task_timeout_s={config.task_timeout_s:g}"
    except RuntimeUnavailableError:
        raise
    except Exception as e:  # the agent or the env failed: an outcome, recorded
        if isinstance(e.__cause__, RuntimeUnavailableError):
            raise e.__cause__ from e
        status, error = "error", f"{type(e).__name__}: {e}"
        (ep_dir / "traceback.txt").write_text(traceback.format_exc())
    finally:
        wall = time.perf_counter() - t0
        if env is not None:
            with contextlib.suppress(Exception):
                env.close()
        logger.close()
    after = endpoint.stats()
    delta = stats_delta(before, after)
    usage = llm.usage_log if llm is not None else []
    record = EpisodeRecord(
        task=task,
        arm=arm_name,
        run=run,
        status=status,
        solved=bool(env is not None and status == "done" and env.resolved),
        score=int(getattr(env, "score", 0) or 0),
        max_score=getattr(env, "max_score", None),
        steps=len(agent.history.env_observations) if agent is not None else 0,
        prompt_tokens=int(delta.get("prompt_tokens", sum(u["prompt_tokens"] for u in usage))),
        cached_tokens=int(delta.get("cached_tokens", sum(u["cached_tokens"] for u in usage))),
        prefilled_tokens=delta.get("prefilled_tokens"),
        splices=dict(delta.get("splices", {})),
        fallbacks=delta.get("fallbacks"),
        requests=int(delta.get("requests", len(usage))),
        stats_source="server" if delta else "client",
        wall_s=round(wall, 3),
        error=error,
    )
    if agent is not None:
        _save_trajectory(agent, llm, record, ep_dir, out)
    return record


def _save_trajectory(agent: Any, llm: Any, record: EpisodeRecord, ep_dir: Path, out: Path) -> None:
    """debug-gym's own trajectory JSON next to the episode's log, and one line of
    ``trajectories.jsonl`` (the replay format: the last prompt sent plus its reply)."""
    with contextlib.suppress(Exception):
        ep_dir.mkdir(parents=True, exist_ok=True)
        (ep_dir / "trajectory.json").write_text(
            json.dumps(agent.build_trajectory(), default=str, indent=1)
        )
    if llm is None or not llm.transcript:
        return
    line = {
        "id": f"{record.task}-{record.arm}-r{record.run}",
        "source": "debug-gym",
        "task": record.task,
        "arm": record.arm,
        "solved": record.solved,
        "tools": llm.tool_schemas,
        "messages": llm.transcript,
    }
    with (out / "trajectories.jsonl").open("a") as f:
        f.write(json.dumps(line, default=str) + "\n")
