"""The prepared GPU check's CPU dry run: ``scripts/gpu_check.sh OUTDIR --dry-run`` assembles the
project as it does on the GPU machine (package-dir layout in a temporary folder, run from
outside the checkout) and runs every section on shrunk shapes; each section leaves a record
that ``leyline bench report`` renders, and the correctness tables hold (the engine against
transformers, the kernel against a float64 rotation)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from leyline_agent.experiments.check import gpu_check
from leyline_agent.experiments.reports import results

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--dry-run"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    return out, proc


def _rows(output: str, first: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in output.splitlines()
        if line.startswith(f"| {first}")
    ]


def test_every_section_passes_and_is_recorded(dry_run):
    out, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for section in gpu_check.SECTIONS:
        rec = json.loads((out / section / results.REPORT_NAME).read_text())
        assert rec["passed"] is True and rec["device"] == "cpu (dry run)"
        assert rec["command"].startswith(f"scripts/gpu_check.sh OUT --dry-run (section {section}")
        assert rec["commit"] and "|---|" in rec["output"]


def test_the_engine_agrees_with_transformers_and_the_kernel_with_float64(dry_run):
    out, _ = dry_run
    mini = json.loads((out / "engine-mini" / results.REPORT_NAME).read_text())["output"]
    rows = _rows(mini, "deepseek_v2 mini") + _rows(mini, "llama mini")
    assert [r[1] for r in rows] == ["float32", "float32", "bfloat16"]
    for row in rows:
        tol = 1e-3 if row[1] == "float32" else 0.5
        assert float(row[2]) < tol and float(row[3]) < tol  # prefill, FORGET vs transformers
    assert rows[0][5].startswith("True") and rows[1][5].startswith("True")  # greedy, fp32
    kernel = json.loads((out / "kernel" / results.REPORT_NAME).read_text())["output"]
    rows = _rows(kernel, "gqa") + _rows(kernel, "mla")
    assert len(rows) == 8
    for row in rows:
        assert float(row[6]) < (1e-6 if row[1] == "float32" else 1e-2) and row[7] == "True"


def test_the_records_render_with_the_device(dry_run, tmp_path):
    out, _ = dry_run
    page = results.render(results.collect(out))
    assert page.count("## check gpu:") == len(gpu_check.SECTIONS)
    assert ", cpu (dry run)" in page
    assert re.search(r"\| llama-1b \| 144 \(64\+16\+64\) \|", page)  # bench splice's table


def test_every_wheel_the_script_fetches_is_pinned():
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    needed = re.search(r'NEEDED="([^"]+)"', text).group(1).split()
    pins = (ROOT / "scripts" / "constraints.txt").read_text().lower()
    for name in needed:
        assert re.search(rf"^{re.escape(name.lower())}==", pins, re.M), name
