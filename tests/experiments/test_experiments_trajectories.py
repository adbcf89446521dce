"""Trajectories: the generator runs real tools on debug-gym's environment, is seeded and
deterministic; the committed set has the shape of real debugging sessions."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import debug_gym  # noqa: E402, F401  -- set up by scripts/setup.sh; fail, never skip

from leyline_agent.experiments.eval.dataset import installed_task_root  # noqa: E402
from leyline_agent.experiments.replay.trajectories import (  # noqa: E402
    DEFAULT_SET,
    generate_one,
    load_trajectories,
    write_trajectories,
)
from leyline_agent.policies.failed_call import DEFAULT_PATTERNS  # noqa: E402

pytestmark = pytest.mark.slow


def test_generator_is_real_and_deterministic(tmp_path: Path) -> None:
    a = generate_one("purr", seed=3, turns=4, data_dir=tmp_path / "data")
    b = generate_one("purr", seed=3, turns=4, data_dir=tmp_path / "data")
    assert a.model_dump_json() == b.model_dump_json()
    roles = [m["role"] for m in a.messages]
    assert roles == ["system", "user"] + ["assistant", "tool"] * 4
    source = (installed_task_root() / "purr" / "purr_code.py").read_text()
    # turn 0 views the code: the tool output quotes the real file, numbered
    assert (
        "def cat_status(name, k):" in source
        and "def cat_status(name, k):" in a.messages[3]["content"]
    )
    assert "test session starts" in a.messages[0]["content"]  # real pytest output in the prompt
    names = {t["function"]["name"] for t in a.tools}
    assert {"view", "eval", "pdb", "bash", "edit"} <= names
    path = write_trajectories([a], tmp_path / "t.jsonl")
    assert load_trajectories(path)[0] == a


def test_committed_set_shape() -> None:
    trajs = load_trajectories(DEFAULT_SET)
    assert len(trajs) >= 10
    assert all(10 <= t.turns() <= 40 for t in trajs)
    sizes = [len(m["content"]) for t in trajs for m in t.messages if m["role"] == "tool"]
    assert min(sizes) < 200 and max(sizes) > 4000  # tens to thousands of tokens
    failed = [
        m
        for t in trajs
        for m in t.messages
        if m["role"] == "tool" and any(re.search(p, m["content"], re.M) for p in DEFAULT_PATTERNS)
    ]
    assert failed, "no failed call in the set"
