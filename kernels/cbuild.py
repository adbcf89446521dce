"""Compiling the CPU kernels' C sources on first use, once per machine.

``Library(source, declare)`` is one kernel's library: on first use it compiles ``source``
with the system's C compiler (``$CC``, ``cc`` or ``gcc``; ``-O3 -march=native -fopenmp``)
into ``$LEYLINE_KERNEL_CACHE`` (default: a folder under the temp dir), keyed by the source,
the headers beside it (``vec.h``), the compiler, the flags and the CPU's flags, loads it and
lets ``declare`` give its entry points their ctypes signatures. A concurrent build writes its own temp file and renames it into place. The
OpenMP runtime the library links is the one torch already loaded (same soname), so they
share one thread pool. What failed is returned, not raised: a kernel that did not build
leaves its callers on their torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["Library", "load"]

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")


class Library:
    """A C source's library, built and loaded once per process, when first asked for."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source, self._declare = source, declare
        self._loaded: tuple[ctypes.CDLL | None, str | None] | None = None

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None if it did not build (``error`` says why)."""
        if self._loaded is None:
            lib, error = load(self.source)
            if lib is not None:
                self._declare(lib)
            self._loaded = (lib, error)
        return self._loaded[0]

    @property
    def error(self) -> str | None:
        """Why the library is not available (None if it is)."""
        self.get()
        assert self._loaded is not None
        return self._loaded[1]


def load(source: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """The built library of ``source``, or None and why it did not build."""
    try:
        return ctypes.CDLL(str(_build(source))), None
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        return None, f"{source.name} did not build: {detail}"


def _build(source: Path) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True)
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    for part in (source.read_bytes(), *headers, version.stdout.encode(), " ".join(FLAGS).encode()):
        key.update(part)
    key.update(_cpu_flags().encode())
    root = Path(
        os.environ.get("LEYLINE_KERNEL_CACHE") or Path(tempfile.gettempdir()) / "leyline-kernels"
    )
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not out.exists():
        fd, tmp = tempfile.mkstemp(dir=root, suffix=".so")
        os.close(fd)
        try:
            subprocess.run(
                [cc, *FLAGS, str(source), "-o", tmp, "-lm"],
                capture_output=True,
                text=True,
                check=True,
            )
            os.replace(tmp, out)  # atomic: concurrent builders each write their own file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
