"""Benchmark results that document themselves: ``report.json`` per run, ``docs/results.md``.

Every ``leyline bench ...`` and ``leyline check ...`` run is recorded (``recorded``): what it
printed, verbatim, goes to ``<out>/report.json`` beside its other outputs, with the command
that produced it, the machine (CPU model, cores, memory), the date, the git commit and the
load average before and after. ``leyline bench report`` renders every ``report.json`` under
``runs/`` into ``docs/results.md``: each section is one run's own output under its command,
so no figure in the results is typed by hand. ``runs/**/report.json`` is tracked by git
(the rest of ``runs/`` is not), so the page regenerates from a clean checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "REPORT_NAME", "add_arguments", "collect", "machine", "main", "recorded", "render",
    "write_record", "write_results",
]  # fmt: skip

REPORT_NAME = "report.json"
_ORDER = (
    "bench engine", "bench splice", "bench serve", "bench mechanism", "bench side-by-side",
    "check gpu",
)  # fmt: skip


def machine() -> dict[str, Any]:
    """CPU model, cores and memory of this machine."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "system": platform.system()}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


class Tee(io.TextIOBase):
    """Writes to the real stream and keeps a copy."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.copy.write(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()


def recorded(verb: str, handler: Callable[[Any], int], default_out: Path) -> Callable[[Any], int]:
    """``handler`` whose printed output is recorded in ``<args.out or default_out>/report.json``
    when it succeeds (a failed run leaves the previous record in place)."""

    def run(args: Any) -> int:
        out = getattr(args, "out", None)
        out_dir = Path(out) if out is not None else default_out
        if out_dir.suffix:  # an output file: record beside it
            out_dir = out_dir.parent
        argv = sys.argv[1:]
        started, load_before, tee = dt.datetime.now(dt.UTC), load_average(), Tee(sys.stdout)
        with contextlib.redirect_stdout(tee):
            rc = int(handler(args) or 0)
        if rc == 0:
            command = "leyline " + shlex.join(argv)
            write_record(out_dir, verb, command, started, load_before, tee.copy.getvalue())
        return rc

    return run


def write_record(
    out_dir: Path,
    verb: str,
    command: str,
    started: dt.datetime,
    load_before: list[float] | None,
    output: str,
    **extra: Any,
) -> Path:
    """Write one run's ``report.json`` into ``out_dir``; ``extra`` keys override or add fields
    (``commit`` where the run has no git checkout, ``device`` for a GPU)."""
    record = {
        "verb": verb,
        "command": command,
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "duration_s": round((dt.datetime.now(dt.UTC) - started).total_seconds(), 1),
        "commit": _commit(),
        "machine": machine(),
        "load_before": load_before,
        "load_after": load_average(),
        "output": output,
        **extra,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REPORT_NAME
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def collect(root: Path) -> list[dict[str, Any]]:
    """Every run record under ``root``, in the page's order (by verb, then folder)."""
    records = []
    for path in sorted(Path(root).rglob(REPORT_NAME)):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and "output" in rec and "command" in rec:
            rec["folder"] = str(path.parent.relative_to(root))
            records.append(rec)
    rank = {v: i for i, v in enumerate(_ORDER)}
    return sorted(records, key=lambda r: (rank.get(r.get("verb", ""), len(rank)), r["folder"]))


def _body(output: str) -> list[str]:
    """A run's output as markdown: its tables as tables, every other line kept verbatim."""
    lines, text = [], []

    def flush_text() -> None:
        if text:
            lines.extend(["```", *text, "```", ""])
            text.clear()

    for line in output.rstrip().splitlines():
        if line.lstrip().startswith("|"):
            flush_text()
            lines.append(line.strip())
        else:
            if lines and lines[-1].startswith("|"):
                lines.append("")
            if line.strip():
                text.append(line.rstrip())
    flush_text()
    return lines


def render(records: list[dict[str, Any]]) -> str:
    """``docs/results.md``: one section per run, its command, machine, date and load."""
    out = [
        "# Results",
        "",
        "Written by `leyline bench report` from the runs recorded under `runs/`; do not edit by "
        "hand. Each section is one run's own output, under the command that produced it. The "
        "machines are shared and noisy: read the ratios each run measured side by side, not "
        "the decimals across runs.",
        "",
    ]
    for rec in records:
        m = rec.get("machine") or {}
        out += [
            f"## {rec.get('verb', 'run')}: `{rec['folder']}`",
            "",
            f"- command: `{rec['command']}`",
            f"- machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB"
            + (f", {rec['device']}" if rec.get("device") else ""),
            f"- date: {rec.get('date')} ({rec.get('duration_s')} s), commit {rec.get('commit')}",
            f"- load average before / after: {rec.get('load_before')} / {rec.get('load_after')}",
            "",
            *_body(rec["output"]),
            "",
        ]
    if not records:
        out.append("No recorded runs yet: run a `leyline bench` command, then this one again.")
    return "\n".join(out).rstrip() + "\n"


def write_results(runs: Path, out: Path) -> int:
    """Render the records under ``runs`` into ``out``; the number of runs rendered."""
    records = collect(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(records))
    return len(records)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=Path, default=Path("runs"), help="where the records are")
    p.add_argument("--to", type=Path, default=Path("docs/results.md"), help="the page to write")


def main(args: argparse.Namespace) -> int:
    """``leyline bench report``: every record under ``--runs`` into the page ``--to``."""
    n = write_results(args.runs, args.to)
    print(f"{args.to}: {n} recorded run(s) from {args.runs}")
    return 0
