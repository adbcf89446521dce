"""The ``slow`` marker's rule, as a pytest plugin (``tests/conftest.py`` loads it).

A test module whose tests take more than about 5 s together on an idle 2-core machine (a real
server, an agent loop, a benchmark, fuzzing) says so with ``pytestmark = pytest.mark.slow``
(the marker is registered in ``pyproject.toml``); ``make check`` runs ``-m "not slow"``,
``make test`` runs everything.

The plugin times every module (set-up, call and tear-down of its tests, so a module-scoped
server's start-up counts) and lists, at the end of the run, the modules without the marker
that took longer than ``--unmarked-slow-s`` seconds (default 5). With the option given, such a
module fails the run (exit status 1), so a forgotten marker shows in ``make check``; without
it the list is a report only (timings on a loaded machine are not evidence of a slow module).
"""

from __future__ import annotations

from collections import defaultdict

DEFAULT_S = 5.0


class SlowRule:
    """Module durations and which modules carry the ``slow`` marker, for one session."""

    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.unmarked: set[str] = set()
        self.over: list[tuple[float, str]] = []

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            if item.get_closest_marker("slow") is None:
                self.unmarked.add(item.nodeid.split("::")[0])

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid.split("::")[0]] += report.duration

    def pytest_sessionfinish(self, session) -> None:
        limit = DEFAULT_S if self.limit_s is None else self.limit_s
        self.over = sorted(
            ((s, m) for m, s in self.seconds.items() if m in self.unmarked and s > limit),
            reverse=True,
        )
        if self.over and self.limit_s is not None and session.exitstatus == 0:
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.over:
            return
        limit = DEFAULT_S if self.limit_s is None else self.limit_s
        terminalreporter.section(f"modules over {limit:g} s without the slow marker")
        for s, module in self.over:
            terminalreporter.write_line(f"{s:7.1f} s  {module}")
        terminalreporter.write_line("mark them: pytestmark = pytest.mark.slow")


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--unmarked-slow-s",
        type=float,
        default=None,
        help="fail the run when a module without the slow marker takes longer (seconds)",
    )


def pytest_configure(config) -> None:
    config.pluginmanager.register(SlowRule(config.getoption("--unmarked-slow-s")), "slow-rule")
