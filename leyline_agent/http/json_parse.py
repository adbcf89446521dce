"""JSON parsing of request bodies whose hold on the GIL and whose work are bounded (``loads``).

``json.loads`` is one C call: it holds the GIL from start to end, so running it on a worker
thread does not help the event loop (a 16 MiB body of 8 million numbers holds every other
thread for half a second or more). ``loads`` parses a body whose structure is small (fewer
than ``C_PARSE_VALUES`` commas and brackets, in strings or not: about 15 ms of one core
here) with ``json.loads``. Any other body goes through the standard library's pure-Python
scanner: the same grammar and the same values, its strings still decoded by the C string
scanner, but its objects and arrays walked in Python, which gives other threads the GIL
every switch interval. That walk costs about 20x the CPU of ``json.loads`` per value (nothing measurable
on a body of long strings, a prompt), so it counts the values it parses and stops past
``MAX_JSON_VALUES`` (``TooManyValuesError``): a body of millions of small values is refused
after a fraction of a second of one thread, not parsed for tens of seconds. Run ``loads`` off
the event loop (``http.offload.off_loop``; ``guards.parse_body`` does both).
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
from collections.abc import Callable
from typing import Any

__all__ = ["C_PARSE_VALUES", "MAX_JSON_VALUES", "TooManyValuesError", "loads"]

C_PARSE_VALUES = 1 << 17  # 131,072: about 15 ms of json.loads here (module doc)
MAX_JSON_VALUES = 1 << 18  # 262,144: far above any request's (4,096 messages, 128 Ki ids)

type _Scan = Callable[[str, int], tuple[Any, int]]


class TooManyValuesError(ValueError):
    """A body of more than ``MAX_JSON_VALUES`` JSON values."""


def loads(raw: bytes | str, max_values: int = MAX_JSON_VALUES) -> Any:
    """``raw`` parsed as ``json.loads`` parses it (the same values and errors:
    ``json.JSONDecodeError``, ``UnicodeDecodeError``, ``RecursionError``), holding the GIL only
    briefly at a time; ``TooManyValuesError`` past ``max_values`` values (module doc)."""
    data = raw if isinstance(raw, bytes) else raw.encode()
    if data.count(b",") + data.count(b"[") + data.count(b"{") < C_PARSE_VALUES:
        return json.loads(raw)
    text = raw.decode(json.detect_encoding(raw)) if isinstance(raw, bytes) else raw
    return _CountingDecoder(max_values).decode(text)


class _CountingDecoder(json.JSONDecoder):
    """The pure-Python scanner, counting every value it parses inside an object or array."""

    def __init__(self, max_values: int) -> None:
        super().__init__()
        self.max_values = self.left = max_values
        self.parse_array = self._array
        self.parse_object = self._object
        self.scan_once = json.scanner.py_make_scanner(self)

    def _counted(self, scan_once: _Scan) -> _Scan:
        def scan(string: str, idx: int) -> tuple[Any, int]:
            self.left -= 1
            if self.left < 0:
                raise TooManyValuesError(f"more than {self.max_values} JSON values")
            return scan_once(string, idx)

        return scan

    def _array(self, s_and_end: tuple[str, int], scan_once: _Scan) -> tuple[list[Any], int]:
        return json.decoder.JSONArray(s_and_end, self._counted(scan_once))  # type: ignore[attr-defined]

    def _object(
        self, s_and_end: tuple[str, int], strict: bool, scan_once: _Scan, *rest: Any
    ) -> Any:
        return json.decoder.JSONObject(s_and_end, strict, self._counted(scan_once), *rest)  # type: ignore[attr-defined]
