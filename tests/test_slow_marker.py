"""The ``slow`` marker's rule (``leyline_agent/testing/slow_marker.py``): ``make check`` leaves
out the marked modules, and a module that takes longer than the limit without the marker fails
the run, by name (checked on a real pytest run over made-up modules; ``-m "not slow"``
is pytest's own selection)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLEEPY = "import time\n{mark}\n\ndef test_sleeps():\n    time.sleep(0.6)\n"
MARK = "import pytest\npytestmark = pytest.mark.slow\n"


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "markers=slow",
         "-o", "slow_marker_load_scaling=false", "-p", "leyline_agent.testing.slow_marker",
         *args, str(folder)],
        cwd=folder, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )


def test_make_check_runs_the_unmarked_modules_only() -> None:
    text = (ROOT / "Makefile").read_text()
    check = re.search(r"^check:.*?(?=^\S|\Z)", text, re.S | re.M)
    assert check, "the Makefile has a check target"
    assert '-m "not slow"' in check.group(0)
    assert "--unmarked-slow-s" in check.group(0)
    assert "SLOW_TESTS" not in text, "the marker replaces the hand-kept list"


def test_an_unmarked_slow_module_fails_the_run_by_name(tmp_path: Path) -> None:
    (tmp_path / "test_unmarked.py").write_text(SLEEPY.format(mark=""))
    (tmp_path / "test_marked.py").write_text(SLEEPY.format(mark=MARK))
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    pass\n")
    out = _pytest(tmp_path, "--unmarked-slow-s", "0.3")
    assert out.returncode == 1, out.stdout
    listed = out.stdout.split("without the slow marker", 1)[-1]
    assert "test_unmarked.py" in listed
    assert "test_marked.py" not in listed and "test_quick.py" not in listed
    assert "3 passed" in out.stdout


def test_not_slow_never_imports_a_module_marked_slow(tmp_path: Path) -> None:
    """With ``-m "not slow"`` a module marked slow as a whole is not imported (this one
    raises when it is); without ``-m`` it is, and fails the run."""
    heavy = MARK + "raise RuntimeError('the slow module was imported')\n\ndef test_x():\n    pass\n"
    (tmp_path / "test_heavy.py").write_text(heavy)
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    pass\n")
    quick = _pytest(tmp_path, "-m", "not slow")
    assert quick.returncode == 0, quick.stdout
    assert "1 passed" in quick.stdout and "was imported" not in quick.stdout
    full = _pytest(tmp_path)
    assert full.returncode != 0 and "the slow module was imported" in full.stdout
