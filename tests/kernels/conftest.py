"""Fixtures of the CPU kernels' tests: ``threads``, each test run with 1 and with 2 torch
threads (the kernels split their work across threads)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)
