"""Configuration of ``leyline eval mini-nightmare``: arms, agent settings, generation.

The agent settings default to those of debug-gym's own ``configs/mini_nightmare.yaml``
(froggy, 50 steps, tools bash/view/pdb/edit/eval, 30 s test timeout). ``--config FILE``
merges a YAML file over the defaults; its ``agent``, ``tools`` and ``env`` sections have
debug-gym's meaning, so debug-gym's own config file can be passed as is (its other sections,
``llm``, ``dataset``, ``terminal``, are ignored: the harness sets those).

An arm is a set of Leyline policies (sent through ``wrap_openai``) plus agent overrides:
- ``baseline``: no policies, debug-gym unchanged;
- ``stale-tool``: ``StaleToolTruncation``;
- ``stale-tool+failed-call``: ``StaleToolTruncation`` and ``FailedCallDetector``;
- ``history-cutoff``: no policies, debug-gym's own blunt ``max_history_steps_cutoff``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from leyline_agent.errors import LeylineError

__all__ = ["ArmSpec", "EvalConfig", "load_eval_config", "resolve_arms"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ArmSpec(BaseModel):
    model_config = _FROZEN

    policies: list[Any] = Field(default_factory=list, description="load_policies specs")
    agent: dict[str, Any] = Field(default_factory=dict, description="agent arg overrides")


class EvalConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    agent: dict[str, Any]
    tools: list[Any]
    env: dict[str, Any]
    arms: dict[str, ArmSpec]
    generate: dict[str, Any]
    task_timeout_s: float = 900.0
    request_timeout_s: float = 300.0


DEFAULTS: dict[str, Any] = {
    "agent": {"type": "froggy", "max_steps": 50},
    "tools": ["bash", "view", "pdb", "edit", "eval"],
    "env": {"run_timeout": 30},
    "arms": {
        "baseline": {},
        "stale-tool": {"policies": [{"name": "stale-tool", "keep": 2}]},
        "stale-tool+failed-call": {
            "policies": [{"name": "stale-tool", "keep": 2}, {"name": "failed-call"}]
        },
        "history-cutoff": {"agent": {"max_history_steps_cutoff": 6}},
    },
    "generate": {"max_tokens": 256, "temperature": 0.0},
    "task_timeout_s": 900.0,
    "request_timeout_s": 300.0,
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_eval_config(path: str | Path | None = None, **overrides: Any) -> EvalConfig:
    """Defaults, then the YAML file at ``path``, then ``overrides`` (deep-merged)."""
    data = copy.deepcopy(DEFAULTS)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise LeylineError(f"--config: no such file {p}")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise LeylineError(f"--config: {p} must hold a mapping at top level")
        data = _merge(data, loaded)
    data = _merge(data, overrides)
    try:
        return EvalConfig.model_validate(data)
    except ValueError as e:
        raise LeylineError(f"--config: {e}") from e


def resolve_arms(spec: str, config: EvalConfig) -> list[str]:
    """Comma list of arm names -> validated, order kept."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise LeylineError("--arms: give a comma-separated list of arms")
    unknown = [n for n in names if n not in config.arms]
    if unknown:
        raise LeylineError(
            f"--arms: unknown arm(s) {', '.join(unknown)}; known: {', '.join(config.arms)}"
        )
    return list(dict.fromkeys(names))
