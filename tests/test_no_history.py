"""No history in the tree's prose: no commit hash and no issue reference in the README, the
docs, docstrings, comments or test names.

Code explains what it does and why; what happened when belongs in git. The scan reads the
prose only: Markdown files whole; of Python files their docstrings, comments and test
function names (read with ``ast`` and ``tokenize``, so hex constants and digests in code are
never looked at); of C files their comments. ``docs/results.md`` is left out: the benchmarks
generate it, with the state of the tree they ran on; so is this file, which names what it
looks for.

What counts:
- a commit hash: a run of 7 to 40 hex digits with a letter and a digit in it, standing alone
  (not part of a longer word, not after ``0x``); or a run of 7 to 40 plain digits quoted in
  backticks after "at", "commit", "since", "before" or "after";
- an issue or pull request reference: "issue 10", "issues 3", "PR 4", "#12", or "the issue"
  (the task a change was made for).

The patterns are tested too, on made-up text, so that the scan can fail and does not flag
hex constants, digests, plain numbers or words made of hex letters.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY_FOLDERS = ("leyline_agent", "policies", "kernels", "experiments", "tests", "scripts")
GENERATED = {ROOT / "docs" / "results.md"}
SELF = Path(__file__).resolve()  # names the patterns it looks for

HASH = re.compile(r"(?<![0-9A-Za-z_-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_-])")
DIGIT_HASH = re.compile(r"\b(?:at|commit|since|before|after)\s+`+\d{7,40}`+", re.I)
ISSUE = re.compile(
    r"\bissues?\s+#?\d+\b|\bPRs?\s+#?\d+\b|(?<![\w&/#])#\d+\b|\bthe issue\b|\bissue's\b", re.I
)


def history(text: str) -> list[str]:
    """Every commit hash or issue reference in ``text``."""
    found = [m.group(0) for m in HASH.finditer(text)]
    found += [m.group(0) for m in DIGIT_HASH.finditer(text)]
    return found + [m.group(0) for m in ISSUE.finditer(text)]


def python_prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring, comment and test function name of a Python source."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
            "test"
        ):
            yield node.lineno, node.name.replace("_", " ")
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string.lstrip("#")


def c_prose(source: str) -> Iterator[tuple[int, str]]:
    for m in re.finditer(r"/\*.*?\*/|//[^\n]*", source, re.S):
        yield source.count("\n", 0, m.start()) + 1, m.group(0)


def prose_files() -> Iterator[tuple[Path, Iterator[tuple[int, str]]]]:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]:
        if path.exists() and path not in GENERATED:
            yield path, enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
    for folder in PY_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts and path.resolve() != SELF:
                yield path, python_prose(path.read_text(encoding="utf-8"))
    for path in sorted([*(ROOT / "kernels").glob("*.c"), *(ROOT / "kernels").glob("*.h")]):
        yield path, c_prose(path.read_text(encoding="utf-8"))


def test_no_commit_hash_or_issue_number_in_the_prose() -> None:
    problems = [
        f"{path.relative_to(ROOT)}:{line}: {hit!r}"
        for path, texts in prose_files()
        for line, text in texts
        for hit in history(text)
    ]
    assert not problems, "history in the prose (say what the code does, not when):\n" + "\n".join(
        problems
    )


def test_the_scan_reads_every_kind_of_file() -> None:
    kinds = {path.suffix for path, _ in prose_files()}
    assert {".md", ".py", ".c"} <= kinds


# ---- the patterns themselves --------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "fixed in `a5b1de2`",
        "measured at ``7304647`` (three runs)",
        "since 2ba2d91, the kernel",
        "commit 158d8e3d9e1b2c3a4f5e6d7c8b9a0f1e2d3c4b5a",
        "as issue 10 asks",
        "see #12",
        "(Issues 3 and 4)",
        "PR 7 added it",
        "the test of the issue's three reproductions",
        "The issue wants a 409",
    ],
)
def test_the_patterns_find_history(text: str) -> None:
    assert history(text), text


@pytest.mark.parametrize(
    "text",
    [
        "magic = 0x5f3759df",
        "sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "a deadbeef or defaced word",
        "1234567 rows, max_tokens=1000000, ``65536`` tokens",
        "rope_theta 1000000.0",
        "ids like call_ab12cd34ef and leyline-conv-1a2b3c4d5e",
        "an issue the engine must not have",
        "shape [1, H, N, d] and # 4 rows",
    ],
)
def test_the_patterns_leave_code_and_plain_prose_alone(text: str) -> None:
    assert history(text) == [], text


def test_the_python_reader_sees_docstrings_comments_and_test_names_only() -> None:
    source = (
        '"""Module: fixed in a5b1de2."""\n'
        "X = 'a5b1de2'  # issue 10\n"
        "def test_as_issue_11_asks():\n"
        '    """The issue."""\n'
    )
    texts = [t for _, t in python_prose(source)]
    assert sorted(h for t in texts for h in history(t)) == sorted(
        ["a5b1de2", "issue 10", "issue 11", "The issue"]
    )
