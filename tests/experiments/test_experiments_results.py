"""Benchmark records and the results page: every bench verb records its own output, and
``docs/results.md`` is exactly what ``leyline bench report`` renders from ``runs/``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from leyline_agent.cli import build_parser
from leyline_agent.cli import main as cli_main
from leyline_agent.experiments.cli import load
from leyline_agent.experiments.reports import results

ROOT = Path(__file__).resolve().parents[2]


def _table_handler(args: argparse.Namespace) -> int:
    print("warm-up done")
    print("| arm | C | ratio |")
    print("|---|---|---|")
    print("| splice | 4 | 0.55 |")
    return int(args.rc)


def test_a_recorded_run_keeps_its_output_command_and_machine(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["leyline", "bench", "demo-verb", "--out", str(tmp_path)])
    run = results.recorded("bench demo-verb", _table_handler, tmp_path / "unused")
    assert run(argparse.Namespace(out=tmp_path, rc=0)) == 0
    assert "| splice | 4 | 0.55 |" in capsys.readouterr().out  # still printed
    rec = json.loads((tmp_path / results.REPORT_NAME).read_text())
    assert rec["command"] == f"leyline bench demo-verb --out {tmp_path}"
    assert rec["output"].splitlines()[-1] == "| splice | 4 | 0.55 |"
    assert rec["machine"]["cores"] >= 1 and rec["verb"] == "bench demo-verb"
    assert rec["date"].endswith("UTC") and "load_before" in rec


def test_a_failed_run_leaves_the_previous_record(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["leyline", "bench", "demo-verb"])
    run = results.recorded("bench demo-verb", _table_handler, tmp_path)
    assert run(argparse.Namespace(out=None, rc=0)) == 0
    before = (tmp_path / results.REPORT_NAME).read_text()
    assert run(argparse.Namespace(out=None, rc=3)) == 3
    assert (tmp_path / results.REPORT_NAME).read_text() == before


def test_report_renders_every_record_under_its_command(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    for folder, verb, rc_line in (("mech", "bench mechanism", "| radix | 1 |"),
                                  ("eng", "bench engine", "| llama | 8192 |")):  # fmt: skip
        monkeypatch.setattr("sys.argv", ["leyline", *verb.split(), "--x", folder])
        run = results.recorded(verb, lambda a, line=rc_line: print(line) or 0, runs / folder)
        assert run(argparse.Namespace(out=None)) == 0
    page = tmp_path / "results.md"
    assert cli_main(["bench", "report", "--runs", str(runs), "--to", str(page)]) == 0
    text = page.read_text()
    assert "- command: `leyline bench engine --x eng`" in text
    assert "| llama | 8192 |" in text and "| radix | 1 |" in text
    assert text.index("bench engine") < text.index("bench mechanism")  # the page's order


def test_every_benchmark_verb_records_its_output():
    parser = build_parser()
    cmd = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = cmd.choices["bench"]
    verbs = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"mechanism", "side-by-side", "engine", "serve", "splice", "soak", "grammar", "drift"} <= set(verbs)
    for name, sub in verbs.items():
        load(sub)  # the verb's module gives its options and run when it is chosen
        func = sub.get_default("func")
        if name == "report":
            continue
        assert func.__qualname__.startswith("recorded."), f"bench {name} is not recorded"


def test_results_page_is_what_the_report_renders_from_runs():
    page = ROOT / "docs" / "results.md"
    assert page.is_file(), "docs/results.md is missing: run `leyline bench report`"
    assert page.read_text() == results.render(results.collect(ROOT / "runs")), (
        "docs/results.md is out of date with runs/: run `leyline bench report`"
    )
