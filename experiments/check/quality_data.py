"""Agent conversations for ``leyline check quality``, built from real command output.

``generate()`` writes a small Python package (``ledger/``: settings, an accounts module with
a bug, a failing test) into a temp folder, commits it with fixed authors and dates, runs
real commands there (``ls``, ``cat``, ``grep -rn``, ``git log``, ``wc -l``, a failing
``pytest``) and assembles agent conversations from what they print: a task, assistant
turns that call a command, tool messages that hold its output, a stale output to stub, and
a new question. The output is kept in ``data/quality_conversations.json`` (regenerate with
``python -m leyline_agent.experiments.check.quality_data``): run-dependent parts of the output
(pytest's timing, the temp path) are normalised so the file is stable.

Two kinds of conversations:

- ``general`` (>= 30): the stubbed output is one of the first tool outputs, the question
  asks about the work so far; compared by first token, top-1 logprob and greedy answers.
- ``fact`` (12): the stubbed output is ``cat ledger/settings.py`` and the question asks for
  one of its numbers; the answer starts with ``NAME = `` and the number follows. In half of them a later assistant turn quotes the number (right after
  the stub, or two turns later); in the other half it appears only inside the stubbed span.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["DATA", "generate", "load_conversations"]

DATA = Path(__file__).resolve().parents[1] / "data" / "quality_conversations.json"

SYSTEM = (
    "You are a coding agent working in a Python repository. You run shell commands, read "
    "their output and answer the user's questions briefly."
)

SETTINGS = {  # name -> value, one line each in ledger/settings.py: the fact cases' numbers
    "MAX_RETRIES": 7,
    "TIMEOUT_S": 45,
    "PAGE_SIZE": 250,
    "PORT": 8431,
    "FEE_CENTS": 35,
    "CACHE_TTL_S": 3600,
}

_FILES = {
    "README.md": "# ledger\n\nA tiny double-entry ledger. Run the tests with `pytest -q`.\n",
    "pyproject.toml": '[project]\nname = "ledger"\nversion = "0.3.1"\n',
    "ledger/__init__.py": '"""A tiny double-entry ledger."""\n\nfrom .accounts import Account, transfer\n',
    "ledger/settings.py": '"""Service settings."""\n\n'
    + "".join(f"{k} = {v}\n" for k, v in SETTINGS.items()),
    "ledger/accounts.py": '''"""Accounts and transfers, amounts in cents."""

from dataclasses import dataclass

from .settings import FEE_CENTS


@dataclass
class Account:
    name: str
    balance: int = 0


def transfer(src: Account, dst: Account, amount: int) -> None:
    """Move amount from src to dst; src also pays the fee."""
    if amount <= 0:
        raise ValueError("amount must be positive")
    if src.balance < amount + FEE_CENTS:
        raise ValueError("insufficient funds")
    src.balance -= amount
    dst.balance += amount + FEE_CENTS
''',
    "ledger/report.py": '''"""Text reports of accounts."""

from .settings import PAGE_SIZE


def pages(accounts):
    """Split accounts into pages of PAGE_SIZE."""
    return [accounts[i : i + PAGE_SIZE] for i in range(0, len(accounts), PAGE_SIZE)]


def line(account):
    return f"{account.name:<12} {account.balance / 100:>10.2f}"
''',
    "tests/test_accounts.py": '''from ledger import Account, transfer


def test_transfer_moves_the_amount():
    a, b = Account("a", 1000), Account("b", 0)
    transfer(a, b, 200)
    assert b.balance == 200


def test_transfer_charges_the_fee_to_the_sender():
    a, b = Account("a", 1000), Account("b", 0)
    transfer(a, b, 200)
    assert a.balance == 1000 - 200 - 35


def test_refuses_a_negative_amount():
    a, b = Account("a", 1000), Account("b", 0)
    try:
        transfer(a, b, -5)
    except ValueError:
        return
    raise AssertionError("no error")
''',
}

_COMMITS = (
    ("Initial ledger: accounts and transfers", ["README.md", "pyproject.toml", "ledger/__init__.py", "ledger/accounts.py"]),
    ("Settings module with the service limits", ["ledger/settings.py"]),
    ("Paged text reports", ["ledger/report.py"]),
    ("Tests for transfers", ["tests/test_accounts.py"]),
)  # fmt: skip

COMMANDS = (
    "ls",
    "ls ledger tests",
    "cat ledger/accounts.py",
    "cat ledger/settings.py",
    "cat ledger/report.py",
    "cat tests/test_accounts.py",
    "grep -rn FEE_CENTS ledger tests",
    "grep -rn balance ledger",
    "git log --oneline",
    "git log -2",
    "wc -l ledger/*.py tests/*.py",
    "python -m pytest -q tests",
)

_REMARKS = {
    "ls": "The package is in ledger/ and the tests are in tests/.",
    "ls ledger tests": "There are three modules and one test file.",
    "cat ledger/accounts.py": "transfer() moves the amount and handles the fee.",
    "cat ledger/settings.py": "These are the service settings.",
    "cat ledger/report.py": "The report module pages the accounts.",
    "cat tests/test_accounts.py": "There are three tests for transfer().",
    "grep -rn FEE_CENTS ledger tests": "The fee is defined in settings and used in accounts.",
    "grep -rn balance ledger": "Balances are changed only in transfer().",
    "git log --oneline": "The history has four commits.",
    "git log -2": "The last commits added the tests and the reports.",
    "wc -l ledger/*.py tests/*.py": "The code base is small.",
    "python -m pytest -q tests": "Two tests fail.",
}

_TASKS = (
    "The tests fail. Find out why.",
    "Give me an overview of this repository.",
    "Check how the transfer fee is handled.",
    "Review the ledger package for bugs.",
    "Find where account balances change.",
)

_QUESTIONS = (
    "Which test fails, and why?",
    "In one sentence, what does transfer() do?",
    "What should we change to fix the failing test?",
    "Which file defines the settings?",
    "Summarize what you found so far in one sentence.",
    "How many commits does the repository have?",
)


def _sh(cmd: str, cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True)
    text = (out.stdout + out.stderr).replace(str(cwd), "/work/ledger")
    text = re.sub(r" in \d+\.\d+s", " in 0.05s", text)  # pytest's timing
    return text.rstrip("\n")


def _workspace(root: Path) -> dict[str, str]:
    """Write the package, commit it with fixed dates, run every command: cmd -> output."""
    # pytest's report depends on the terminal: fix its width, and drop CI markers (on CI it stops cutting lines).
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER")},
        "COLUMNS": "80",
        "GIT_AUTHOR_NAME": "Ada Example", "GIT_AUTHOR_EMAIL": "ada@example.com",
        "GIT_COMMITTER_NAME": "Ada Example", "GIT_COMMITTER_EMAIL": "ada@example.com",
        "LC_ALL": "C", "PYTHONDONTWRITEBYTECODE": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }  # fmt: skip
    for rel, text in _FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _sh("git init -q -b main", root, env)
    for k, (msg, files) in enumerate(_COMMITS):
        date = f"2026-11-{10 + k:02d}T09:30:00+00:00"
        _sh(f"git add {' '.join(files)}", root, env)
        _sh(f"git commit -q -m '{msg}'", root, {**env, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date})
    return {c: _sh(c + " -p no:cacheprovider" if "pytest" in c else c, root, env) for c in COMMANDS}


def _say(msgs: list[dict[str, str]], text: str) -> None:
    """An assistant turn; one that follows another assistant turn joins it."""
    if msgs[-1]["role"] == "assistant":
        msgs[-1] = {"role": "assistant", "content": f"{msgs[-1]['content']} {text}"}
    else:
        msgs.append({"role": "assistant", "content": text})


def _step(msgs: list[dict[str, str]], cmd: str, output: str) -> None:
    _say(msgs, f"I'll run `{cmd}`.")
    msgs.append({"role": "tool", "content": output})


def _general(outputs: dict[str, str], k: int, rng: random.Random) -> dict[str, Any]:
    cmds = rng.sample(COMMANDS, rng.randint(3, 5))
    stale = rng.randrange(0, 2)  # the first or second output goes stale
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _TASKS[k % len(_TASKS)]}]
    stale_at = -1
    for i, c in enumerate(cmds):
        _step(msgs, c, outputs[c])
        if i == stale:
            stale_at = len(msgs) - 1
        _say(msgs, _REMARKS[c])
    return {
        "id": f"general-{k:02d}", "kind": "general", "messages": msgs, "stale": stale_at,
        "stub": f"[output of `{cmds[stale]}` removed as stale; run it again to see it]",
        "question": _QUESTIONS[k % len(_QUESTIONS)],
    }  # fmt: skip


def _fact(outputs: dict[str, str], name: str, kind: str, rng: random.Random) -> dict[str, Any]:
    """The stale output is settings.py; ``kind``: quoted_next, quoted_later or span_only."""
    value = SETTINGS[name]
    # other outputs never hold the number: it is in the stubbed span (and the quote) only
    clean = [c for c in COMMANDS if str(value) not in re.findall(r"\d+", outputs[c])]
    others = rng.sample([c for c in clean if "settings" not in c], 3)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Check the service settings."}]
    _step(msgs, "cat ledger/settings.py", outputs["cat ledger/settings.py"])
    stale_at = len(msgs) - 1
    quote = f"Noted: {name} is {value}."
    _say(msgs, quote if kind == "quoted_next" else "I have read the settings.")
    for j, c in enumerate(others):
        _step(msgs, c, outputs[c])
        _say(msgs, quote if kind == "quoted_later" and j == 1 else _REMARKS[c])
    return {
        "id": f"fact-{name.lower()}-{kind}", "kind": kind, "messages": msgs, "stale": stale_at,
        "stub": "[output of `cat ledger/settings.py` removed as stale; run it again to see it]",
        "question": f"What is the value of {name} in ledger/settings.py? Answer with the number only.",
        "answer_prefix": f"{name} = ", "answer": str(value),
    }  # fmt: skip


def generate(n_general: int = 30, seed: int = 0) -> list[dict[str, Any]]:
    """Run the commands in a fresh workspace and assemble the conversations."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="ledger-") as d:
        outputs = _workspace(Path(d))
    convs = [_general(outputs, k, rng) for k in range(n_general)]
    for k, name in enumerate(SETTINGS):
        convs.append(_fact(outputs, name, "quoted_next" if k % 2 == 0 else "quoted_later", rng))
        convs.append(_fact(outputs, name, "span_only", rng))
    return convs


def load_conversations(path: Path = DATA) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_text())


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DATA
    out.write_text(json.dumps(generate(), indent=1) + "\n")
    print(out)
