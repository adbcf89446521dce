"""Offline provisioning of debug-gym's mini_nightmare tasks.

The debug-gym wheel ships the task sources (``data/mini_nightmare/<task>/*.py``) but not the
per-task ``.debugignore`` / ``.debugreadonly`` files, nor the ``patcher`` task's input file
``source_code.txt``; ``MiniNightmareEnv.load_dataset`` would download the whole set. This
module rebuilds the folder from the installed package so that ``load_dataset`` finds it.

- ``.debugreadonly`` holds ``*test*.py`` (the tests are visible but not editable).
- ``.debugignore`` hides byte-code and run outputs.
- ``patcher/source_code.txt`` is the six-line text the patcher tests rewrite; its content is
  fixed by the tests' expected outputs (``test_use_1`` / ``test_use_2``).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from leyline_agent.errors import LeylineError

__all__ = ["TASK_NAMES", "installed_task_root", "provision", "resolve_tasks"]

TASK_NAMES: tuple[str, ...] = (
    "config",
    "counter",
    "grader",
    "pandas_dataframe",
    "patcher",
    "purr",
    "scientific_calculator",
    "shopping_cart",
    "sum_tree",
    "tomorrow_date",
)

_DEBUGREADONLY = "*test*.py\n"
_DEBUGIGNORE = "exps/\n.DS_Store\n__pycache__/\n*.py[cod]\n.pytest_cache/\n"
_PATCHER_SOURCE = "\n".join(
    [
        "Never gonna give you up",
        "Never gonna let you down",
        "Never gonna run around and desert you",
        "Never gonna make you cry",
        "Never gonna say goodbye",
        "Never gonna tell a lie and hurt you",
    ]
)


def installed_task_root() -> Path:
    """Folder of the task sources inside the installed debug-gym wheel (``data/mini_nightmare``)."""
    spec = importlib.util.find_spec("debug_gym")
    if spec is None or spec.origin is None:
        raise LeylineError("debug-gym is not installed: pip install --no-deps debug-gym==1.3.0")
    root = Path(spec.origin).resolve().parent.parent / "data" / "mini_nightmare"
    if not (root / "purr" / "purr_code.py").is_file():
        raise LeylineError(f"the debug-gym wheel has no mini_nightmare sources under {root}")
    return root


def provision(dest: Path, source: Path | None = None) -> Path:
    """Build (or complete) the dataset folder ``dest``; returns it. Idempotent."""
    source = source or installed_task_root()
    dest = Path(dest)
    for task in TASK_NAMES:
        src_dir = source / task
        if not src_dir.is_dir():
            raise LeylineError(f"task {task!r} missing from {source}")
        out = dest / task
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(src_dir.glob("*.py")):
            target = out / f.name
            if not target.exists() or target.read_bytes() != f.read_bytes():
                shutil.copyfile(f, target)
        (out / ".debugreadonly").write_text(_DEBUGREADONLY)
        (out / ".debugignore").write_text(_DEBUGIGNORE)
        if task == "patcher":
            (out / "source_code.txt").write_text(_PATCHER_SOURCE)
    return dest


def resolve_tasks(spec: str | list[str]) -> list[str]:
    """``all`` or a comma list -> validated task names (order kept, duplicates dropped)."""
    names = list(TASK_NAMES) if spec in ("all", ["all"]) else spec
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise LeylineError("--tasks: give 'all' or a comma-separated list of task names")
    unknown = [n for n in names if n not in TASK_NAMES]
    if unknown:
        raise LeylineError(
            f"--tasks: unknown task(s) {', '.join(unknown)}; known: {', '.join(TASK_NAMES)}"
        )
    return list(dict.fromkeys(names))
