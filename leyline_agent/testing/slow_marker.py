"""The ``slow`` marker's rule, as a pytest plugin (``pyproject.toml``'s ``addopts`` loads it).

A test module whose tests take more than about 5 s together on an idle 2-core machine (a real
server, an agent loop, a benchmark, fuzzing) says so with ``pytestmark = pytest.mark.slow``
(the marker is registered in ``pyproject.toml``); ``make check`` runs ``-m "not slow"``,
``make test`` runs everything.

The plugin times every module (set-up, call and tear-down of its tests, so a module-scoped
server's start-up counts) and lists, at the end of the run, the modules without the marker
that took longer than ``--unmarked-slow-s`` seconds (default 5), a limit for an idle machine:
it is multiplied by the load factor (the 1-minute load average per core, at least 1, the
larger of the run's start and end; ini ``slow_marker_load_scaling = false`` turns that off),
since a loaded machine stretches every module. With the option given, such a module fails the
run (exit status 1), so a forgotten marker shows in ``make check``; without it the list is a
report only.

With ``-m "not slow"`` exactly, a test module whose source marks it slow as a whole on one
line (``pytestmark = pytest.mark.slow``, or a list naming it) is not collected at all: every
one of its tests would be deselected anyway, and importing it (an agent framework, an SDK, a
benchmark) is most of what collecting it costs.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

DEFAULT_S = 5.0
_MODULE_MARK = re.compile(r"^pytestmark\s*=.*\bmark\.slow\b", re.M)


def load_factor() -> float:
    """How much busier than idle the machine is: the 1-minute load average per core, >= 1."""
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:  # no load average on this platform
        return 1.0


class SlowRule:
    """Module durations and which modules carry the ``slow`` marker, for one session."""

    def __init__(self, limit_s: float | None, scale: bool) -> None:
        self.limit_s = limit_s
        self.scale = scale
        self.factor = load_factor() if scale else 1.0
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.unmarked: set[str] = set()
        self.over: list[tuple[float, str]] = []

    @property
    def limit(self) -> float:
        return (DEFAULT_S if self.limit_s is None else self.limit_s) * self.factor

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            if item.get_closest_marker("slow") is None:
                self.unmarked.add(item.nodeid.split("::")[0])

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid.split("::")[0]] += report.duration

    def pytest_sessionfinish(self, session) -> None:
        if self.scale:
            self.factor = max(self.factor, load_factor())
        self.over = sorted(
            ((s, m) for m, s in self.seconds.items() if m in self.unmarked and s > self.limit),
            reverse=True,
        )
        if self.over and self.limit_s is not None and session.exitstatus == 0:
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.over:
            return
        terminalreporter.section(
            f"modules over {self.limit:.3g} s without the slow marker (load factor "
            f"{self.factor:.1f})"
        )
        for s, module in self.over:
            terminalreporter.write_line(f"{s:7.1f} s  {module}")
        terminalreporter.write_line("mark them: pytestmark = pytest.mark.slow")


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--unmarked-slow-s",
        type=float,
        default=None,
        help="fail the run when a module without the slow marker takes longer (seconds, idle)",
    )
    parser.addini(
        "slow_marker_load_scaling",
        type="bool",
        default=True,
        help="multiply --unmarked-slow-s by the machine's load factor",
    )


def pytest_configure(config) -> None:
    rule = SlowRule(
        config.getoption("--unmarked-slow-s"), config.getini("slow_marker_load_scaling")
    )
    config.pluginmanager.register(rule, "slow-rule")


def marked_slow(source: str) -> bool:
    """Whether a test module's source marks the whole module slow on one line."""
    return _MODULE_MARK.search(source) is not None


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """Leave a module marked slow as a whole out of a ``-m "not slow"`` run before it is
    imported; no opinion (None) on anything else."""
    name = collection_path.name
    if config.getoption("markexpr", "") != "not slow" or not (
        name.startswith("test_") and name.endswith(".py")
    ):
        return None
    try:
        source = collection_path.read_text(encoding="utf-8")
    except OSError:
        return None
    return True if marked_slow(source) else None
