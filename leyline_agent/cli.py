"""The ``leyline`` command: one entry point, one sub-command module per layer.

Each module in ``_COMMAND_MODULES`` exposes ``register(subparsers)`` which adds its verbs
and sets ``func`` on its parsers. Registration imports no torch: handlers import heavy
modules when they run. Logging (structlog) is configured here and nowhere else.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

import structlog

from leyline_agent.errors import LeylineError

_COMMAND_MODULES = (
    "leyline_agent.policies.cli",  # leyline policies apply|list
    "leyline_agent.engine.checkpoints.cli",  # leyline make-model
    "leyline_agent.server.cli",  # leyline serve
    "leyline_agent.experiments.cli",  # leyline bench|check|eval|demo
)


class _Stderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write (not at configure time:
    a captured or replaced stream may be closed later)."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "warning", json_logs: bool = False) -> None:
    """structlog's lines and the standard library's (uvicorn's, any library's) rendered
    alike on stderr: JSON objects, one a line, under ``json_logs``."""
    lvl = getattr(logging, level.upper(), logging.WARNING)
    renderer = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    stamp = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso")]
    handler = logging.StreamHandler(_Stderr())  # type: ignore[arg-type]
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *stamp],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(lvl)
    logging.captureWarnings(True)  # warnings.warn lines too
    if json_logs:  # progress bars are not lines (Hugging Face's, when a model loads)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, *stamp, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=False,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leyline", description="KV-cache directives for agentic inference."
    )
    parser.add_argument("--log-level", default="warning", help="debug|info|warning|error")
    parser.add_argument("--json-logs", action="store_true", help="log as JSON lines")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for child in sub.choices.values():  # accepted after the verb as well
        child.add_argument("--log-level", default=argparse.SUPPRESS, help="as before the verb")
        child.add_argument(
            "--json-logs", action="store_true", default=argparse.SUPPRESS, help="as before the verb"
        )
    _say_defaults(parser)
    return parser


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        if d in (None, False, argparse.SUPPRESS) or d == [] or "default" in text:
            return text
        shown = ",".join(map(str, d)) if isinstance(d, list) else d
        return f"{text} (default: {shown})".replace("%", "%%").replace("%%(", "%(")


def _say_defaults(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _say_defaults(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.json_logs)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(func(args) or 0)
    except LeylineError as e:
        print(f"leyline: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
