"""Loggers for library code: silent by default, structlog once the ``leyline`` CLI says so.

``structlog.get_logger`` prints every level to stdout until someone calls
``structlog.configure``; in a library that is noise a user cannot turn off with
``logging``. ``get_logger(name)`` returns a logger that, on each call:

- goes to structlog when structlog is configured (the ``leyline`` CLI does it:
  ``cli.configure_logging``, ``--log-level``, ``--json-logs``);
- otherwise goes to the standard library logger ``name`` (``leyline_agent.agent.session``
  ...), as ``"event key=value ..."``; ``leyline_agent``'s package logger has a
  ``NullHandler``, so nothing is printed unless the application configures ``logging``
  (``logging.basicConfig(level=logging.DEBUG)`` shows everything).

No side effect at import beyond the ``NullHandler`` (the standard library's advice for
libraries).
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["Logger", "get_logger"]

logging.getLogger("leyline_agent").addHandler(logging.NullHandler())


class Logger:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def _log(self, level: int, event: str, kw: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(structlog.get_logger(self.name), logging.getLevelName(level).lower())(
                event, **kw
            )
            return
        std = logging.getLogger(self.name)
        if std.isEnabledFor(level):
            fields = " ".join(f"{k}={v!r}" for k, v in kw.items())
            std.log(level, "%s %s", event, fields, stacklevel=3)

    def debug(self, event: str, **kw: Any) -> None:
        self._log(logging.DEBUG, event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._log(logging.INFO, event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._log(logging.WARNING, event, kw)

    def error(self, event: str, **kw: Any) -> None:
        self._log(logging.ERROR, event, kw)


def get_logger(name: str) -> Logger:
    return Logger(name)
