"""The correctness report on a tiny MLA model.

Splice against its ground truth (``RefState``: built from the model's own projections and
RoPE, not from ``rotate_band``) must pick the same first token on every prompt; the bf16
drift of the engine's fp32-math rotation must stay under the round-off bound of bf16
storage (u * sqrt(k), u = 2**-8) and under the drift of bf16-math rotation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.experiments.check.correctness import run_correctness, summary_lines


def test_report(tmp_path: Path) -> None:
    report = run_correctness(tiny_model_dir("deepseek_v2"), tmp_path, prompts=2, max_chain=6)
    ag = report["agreement"]
    assert ag["prompts"] == 2
    assert ag["splice_vs_truth"] == 1.0
    assert ag["splice_vs_truth_max_abs"] < 1e-3
    for row in ag["rows"]:
        assert row["end"] > row["start"] and row["replacement"] < row["end"] - row["start"]
    curve = report["drift"]["curve"]
    assert [p["k"] for p in curve] == list(range(1, 7))
    for p in curve:
        assert 0 < p["fp32_rotation"] <= 2.0**-8 * math.sqrt(p["k"]) * 1.5
    assert curve[-1]["fp32_rotation"] < curve[-1]["bf16_rotation"]
    saved = json.loads((tmp_path / "correctness.json").read_text())
    assert saved["agreement"]["splice_vs_truth"] == ag["splice_vs_truth"]
    assert (tmp_path / "correctness.png").stat().st_size > 0
    assert len(summary_lines(report)) == 2
