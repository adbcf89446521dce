"""Agent trajectories to replay: the JSONL format, loading, and a seeded generator.

Format (one JSON object per line; ``leyline eval mini-nightmare`` writes the same in its
``trajectories.jsonl``): ``{"id", "source", "task", "tools": [OpenAI tool schemas],
"messages": [system, user, assistant(tool_calls), tool, assistant, tool, ...]}``. Every
assistant message marks one request: its prompt is the messages before it.

The generator plays a debugging session on debug-gym's mini_nightmare environment (a
``LocalTerminal``; every tool output is real: file views, pytest runs, pdb sessions, shell
commands) with a seeded random choice of actions, 10-40 turns, some of them failed calls
(a missing file, an unknown tool, a bad shell command). Paths of the temporary working
directory, memory addresses and timings are normalised so that the same seed gives the
same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from leyline_agent.errors import LeylineError

__all__ = [
    "TrajectoryRecord", "add_arguments", "generate", "load_trajectories", "main",
    "write_trajectories",
]

DEFAULT_SET = Path(__file__).resolve().parents[1] / "data" / "trajectories.jsonl"
_SYSTEM = (
    "You debug Python programs. Use one tool per turn: read the code and the tests, run the "
    "tests, step through them with pdb, then edit the code until the tests pass."
)


class TrajectoryRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")

    id: str
    source: str
    task: str | None = None
    tools: list[dict[str, Any]] = []
    messages: list[dict[str, Any]]

    def turns(self) -> int:
        return sum(1 for m in self.messages if m.get("role") == "assistant")

    def request_points(self, max_turns: int | None = None) -> list[int]:
        """Where a replay sends a request: the index of each assistant message (the history
        before it is the prompt), the first ``max_turns`` of them."""
        idx = [i for i, m in enumerate(self.messages) if m.get("role") == "assistant"]
        return idx[:max_turns] if max_turns else idx


def load_trajectories(path: Path) -> list[TrajectoryRecord]:
    if not Path(path).is_file():
        raise LeylineError(f"--trajectories: no such file {path}")
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if line.strip():
            try:
                out.append(TrajectoryRecord.model_validate_json(line))
            except ValueError as e:
                raise LeylineError(f"{path}:{i + 1}: not a trajectory: {e}") from e
    if not out:
        raise LeylineError(f"--trajectories: {path} holds no trajectory")
    return out


def write_trajectories(records: Iterable[TrajectoryRecord], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(r.model_dump_json() + "\n")
    return path


def _tool_schema(tool: Any) -> dict[str, Any]:
    params = {"type": "object", "properties": tool.arguments, "additionalProperties": False}
    if tool.arguments:
        params["required"] = list(tool.arguments)
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": params},
    }


def _normaliser(workdir: str):
    subs = [
        (re.compile(re.escape(workdir)), "/testbed"),
        (re.compile(re.escape(str(Path(sys.executable).parent.parent))), "/venv"),
        (re.compile(r"0x[0-9a-f]{6,}"), "0x7f0000000000"),
        (re.compile(r"\bin \d+\.\d+s\b"), "in 0.01s"),
        (re.compile(r"/tmp/[\w./-]*?RepoEnv[\w-]*"), "/testbed"),
    ]

    def norm(text: str) -> str:
        for pat, rep in subs:
            text = pat.sub(rep, text)
        return text

    return norm


def _code_lines(path: Path) -> list[int]:
    lines = path.read_text().splitlines()
    return [i + 1 for i, ln in enumerate(lines) if ln.strip() and not ln.strip().startswith("#")]


def _action(
    rng: random.Random, task: str, root: Path, turn: int
) -> tuple[str, str, dict[str, Any]]:
    """(thought, tool, arguments) for one turn."""
    code = f"{task}_code.py"
    files = sorted(p.name for p in root.glob("*.py"))
    lines = _code_lines(root / code)
    if turn == 0:
        return "Start by reading the code under test.", "view", {"path": code}
    if turn == 1:
        return "Now the tests.", "view", {"path": "test.py"}
    menu = [
        (14, lambda: ("Let me re-read this file.", "view", {"path": rng.choice(files)})),
        (
            6,
            lambda: (
                "Look at a region more closely.",
                "view",
                {"path": code, "start": (s := rng.choice(lines)), "end": s + rng.randint(5, 15)},
            ),
        ),
        (8, lambda: ("Run the tests.", "eval", {})),
        (
            6,
            lambda: (
                "Run the tests verbosely to see the failures.",
                "bash",
                {"command": "python -m pytest -vv --tb=long test.py"},
            ),
        ),
        (
            4,
            lambda: (
                "Find the definitions.",
                "bash",
                {"command": f"grep -n 'def \\|class ' {code}"},
            ),
        ),
        (
            3,
            lambda: (
                "What is in the repository?",
                "bash",
                {"command": "ls -la && git log --oneline"},
            ),
        ),
        (3, lambda: ("Run the module itself.", "bash", {"command": f"python {code}"})),
        (
            8,
            lambda: ("Set a breakpoint here.", "pdb", {"command": f"b {code}:{rng.choice(lines)}"}),
        ),
        (8, lambda: ("Continue to the breakpoint.", "pdb", {"command": "c"})),
        (5, lambda: ("Step.", "pdb", {"command": rng.choice(["n", "s", "n"])})),
        (4, lambda: ("Where am I?", "pdb", {"command": rng.choice(["where", "l", "args"])})),
        (
            4,
            lambda: (
                "Inspect the local state.",
                "pdb",
                {"command": "p {k: v for k, v in locals().items() if not k.startswith('__')}"},
            ),
        ),
        # failed calls
        (
            2,
            lambda: (
                "Maybe there is a helper module.",
                "view",
                {"path": rng.choice(["utils.py", "helpers.py", "src/main.py"])},
            ),
        ),
        (2, lambda: ("Search for the symbol.", "search", {"query": task})),
        (2, lambda: ("Run the project's test script.", "bash", {"command": "python run_tests.py"})),
        (
            1,
            lambda: (
                "Import the module in a fresh interpreter.",
                "bash",
                {"command": f"python -c 'import {task}_codex'"},
            ),
        ),
    ]
    weights = [w for w, _ in menu]
    return rng.choices([f for _, f in menu], weights=weights)[0]()


def generate_one(task: str, seed: int, turns: int, data_dir: Path) -> TrajectoryRecord:
    """One trajectory of ``turns`` assistant turns on ``task``, real outputs, seeded."""
    from debug_gym.gym.entities import Observation  # noqa: F401  (import check)
    from debug_gym.gym.tools.tool import ToolCall

    from ..eval.eval_config import load_eval_config
    from ..eval.nightmare import load_tasks, make_env, quiet_debug_gym

    quiet_debug_gym()
    from debug_gym.logger import DebugGymLogger

    rng = random.Random(f"{task}:{seed}")
    logger = DebugGymLogger(f"gen-{task}-{seed}", level="ERROR")
    task_data = load_tasks(data_dir, [task])[task]
    env = make_env(task_data, load_eval_config(), logger)
    try:
        info = env.reset()
        norm = _normaliser(str(env.working_dir))
        root = Path(task_data["codebase"])
        system = json.dumps(
            {
                "Role": _SYSTEM,
                "Instructions": info.instructions,
                "Evaluation output of current code": norm(info.eval_observation.observation),
            },
            indent=2,
        )
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Instructions: {info.instructions}"},
        ]
        for turn in range(turns):
            thought, tool, args = _action(rng, task, root, turn)
            call_id = f"call_{seed}_{turn}"
            info = env.step(ToolCall(id=call_id, name=tool, arguments=args), thought, None)
            obs = norm(info.step_observation.observation)
            messages.append(
                {
                    "role": "assistant",
                    "content": thought,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": tool, "arguments": json.dumps(args)},
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "name": tool, "content": obs})
        tools = [_tool_schema(t) for t in env.tools]
    finally:
        env.close()
        logger.close()
    return TrajectoryRecord(
        id=f"{task}-s{seed}", source="generator", task=task, tools=tools, messages=messages
    )


def generate(
    n: int,
    seed: int = 0,
    *,
    tasks: list[str] | None = None,
    min_turns: int = 10,
    max_turns: int = 40,
    data_dir: Path | None = None,
    progress: bool = False,
) -> list[TrajectoryRecord]:
    from ..eval.dataset import TASK_NAMES

    if n < 1:
        raise LeylineError(f"--n: must be >= 1, got {n}")
    if not 1 <= min_turns <= max_turns:
        raise LeylineError(
            f"--min-turns/--max-turns: need 1 <= min <= max, got {min_turns}, {max_turns}"
        )
    # pandas_dataframe reads its data from the network; counter's output is a thread race.
    tasks = tasks or [t for t in TASK_NAMES if t not in ("pandas_dataframe", "counter")]
    rng = random.Random(seed)
    data_dir = data_dir or Path(".leyline") / "mini_nightmare"
    out = []
    t0 = time.monotonic()
    for k in range(n):
        task = tasks[k % len(tasks)]
        turns = rng.randint(min_turns, max_turns)
        out.append(generate_one(task, seed * 1000 + k, turns, data_dir))
        if progress:  # each session runs real tools (pytest, pdb): tens of seconds apiece
            print(
                f"  [{k + 1}/{n}] {out[-1].id}: {turns} turns, {time.monotonic() - t0:.0f} s",
                flush=True,
            )
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", type=Path, default=Path("runs/trajectories.jsonl"), help="output JSONL file"
    )
    p.add_argument("--n", type=int, default=10, help="number of trajectories")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--min-turns", type=int, default=10, help="fewest turns per trajectory")
    p.add_argument("--max-turns", type=int, default=40, help="most turns per trajectory")
    p.add_argument("--tasks", default="all", help="all or a comma list of mini_nightmare tasks")


def main(args: argparse.Namespace) -> int:
    from ..eval.dataset import resolve_tasks

    tasks = None if args.tasks == "all" else resolve_tasks(args.tasks)
    recs = generate(
        args.n,
        args.seed,
        tasks=tasks,
        min_turns=args.min_turns,
        max_turns=args.max_turns,
        progress=True,
    )
    write_trajectories(recs, args.out)
    print(f"{len(recs)} trajectories, {sum(r.turns() for r in recs)} turns -> {args.out}")
    return 0
