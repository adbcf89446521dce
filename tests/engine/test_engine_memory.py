"""``engine.memory.tune_allocator``: glibc's options set unless the environment sets them.

Each case runs in a child process, so that the suite's own allocator is left as it is. What
the settings give (the RSS of a serving process) is measured by ``leyline bench
store-budget`` and ``leyline bench soak-hostile``; here, only which options are set.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from leyline_agent.engine.memory import ARENA_MAX, MMAP_THRESHOLD_BYTES

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
TUNE = "import json; from leyline_agent.engine.memory import tune_allocator as t; print(json.dumps(t()))"


def _tuned(**env: str) -> dict[str, int]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", TUNE], env={**base, **env}, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def test_tune_allocator_sets_both_options():
    assert _tuned() == {
        "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD_BYTES,
        "MALLOC_ARENA_MAX": ARENA_MAX,
    }


def test_an_option_the_environment_sets_is_left_alone():
    assert _tuned(MALLOC_ARENA_MAX="4") == {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD_BYTES}
