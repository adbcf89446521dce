"""Compiling the CPU kernels' C sources on first use, once per machine.

``load(source)`` compiles ``source`` with the system's C compiler (``$CC``, ``cc`` or
``gcc``; ``-O3 -march=native -fopenmp``) into ``$LEYLINE_KERNEL_CACHE`` (default: a folder
under the temp dir), keyed by the source, the compiler, the flags and the CPU's flags, and
loads it. A concurrent build writes its own temp file and renames it into place. The
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
from pathlib import Path

__all__ = ["load"]

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")


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
    for part in (source.read_bytes(), version.stdout.encode(), " ".join(FLAGS).encode()):
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
