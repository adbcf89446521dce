"""``leyline demo`` wiring, shrunk to one session of two turns on a tiny model."""

from __future__ import annotations

from pathlib import Path

from leyline_agent.experiments.replay.replay import ARMS
from leyline_agent.experiments.reports.demo import run_demo


def test_demo_writes_everything(tmp_path: Path) -> None:
    res = run_demo(
        tmp_path / "out",
        tmp_path / "models",
        "deepseek_v2",
        "tiny",
        concurrency=[1],
        prompts=1,
        chain=2,
        progress=False,
        max_turns=2,
    )
    assert (tmp_path / "models" / "deepseek_v2-tiny" / "config.json").is_file()
    assert {r["arm"] for r in res["rows"]} == set(ARMS)
    for f in (
        "mechanism/results.json",
        "mechanism/results.png",
        "correctness/correctness.json",
        "correctness/correctness.png",
    ):
        assert (tmp_path / "out" / f).stat().st_size > 0
    assert len(res["summary"]) == 2
