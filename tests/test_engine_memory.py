"""``engine.memory.tune_allocator``: glibc's options set unless the environment sets them.

What the settings give (the RSS of a serving process) is measured by ``leyline bench
store-budget`` and ``leyline bench soak-hostile``; here, only which options are set.
"""

from __future__ import annotations

import platform

import pytest

from leyline_agent.engine.memory import ARENA_MAX, MMAP_THRESHOLD_BYTES, tune_allocator

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")


def test_tune_allocator_sets_both_options(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert tune_allocator() == {
        "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD_BYTES,
        "MALLOC_ARENA_MAX": ARENA_MAX,
    }


def test_an_option_the_environment_sets_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert tune_allocator() == {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD_BYTES}
