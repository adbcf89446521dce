"""The CPU kernels' build (kernels/cbuild.py): without a C compiler each kernel says it is
unavailable and why, and the engine still serves on its torch paths (a fresh process whose
$CC does not exist and whose kernel cache is empty)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("module", ["decode_attn", "skinny_linear"])
def test_without_a_compiler_a_kernel_is_unavailable_and_says_why(tmp_path, module):
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), LEYLINE_KERNEL_CACHE=str(tmp_path))
    code = (
        f"from leyline_agent.kernels import {module} as k\n"
        "assert not k.available()\n"
        "print(k.build_error())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"{module}.c did not build" in r.stdout and "no-such-cc" in r.stdout


def test_without_a_compiler_a_bf16_engine_decodes_on_its_torch_paths(tmp_path):
    """Both kernels missing: a bf16 decode step (the path both kernels would take) gives the
    logits of a plain transformers forward of the whole sequence, to bf16's precision."""
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), LEYLINE_KERNEL_CACHE=str(tmp_path))
    code = f"""
import torch
from leyline_agent.engine.engine import Engine
from leyline_agent.engine.model.runner import StepInput
from leyline_agent.kernels import decode_attn, skinny_linear
eng = Engine.from_pretrained({str(tiny_model_dir("llama"))!r}, dtype="bfloat16")
assert not decode_attn.available() and not skinny_linear.available()
ids = list(range(5, 40))
r = eng.runner
slots = r.prefill_into_slots([], ids[:-1]) + r.allocator.alloc(1)
got = r.run([StepInput([ids[-1]], slots)])[0]
with torch.inference_mode():
    ref = eng.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
err = (got - ref).abs().max().item() / ref.abs().max().item()
assert err <= 2e-2, err
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
