"""Load policies by name: ``stale-tool``, ``failed-call``, or ``module:Class``.

A spec is a name (``"stale-tool"``), a mapping ``{"name": ..., **knobs}``, or a ``Policy``
instance. ``load_policies`` also takes a YAML file path or a mapping ``{"policies": [...]}``:

    policies:
      - name: stale-tool
        keep: 2
      - failed-call
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from leyline_agent.errors import PolicyError

from .base import Policy
from .failed_call import FailedCallDetector
from .stale_tool import StaleToolTruncation

__all__ = ["BUILTIN_POLICIES", "load_policies", "load_policy", "resolve_policy_class"]

BUILTIN_POLICIES: dict[str, type[Policy]] = {
    StaleToolTruncation.name: StaleToolTruncation,
    FailedCallDetector.name: FailedCallDetector,
}


def resolve_policy_class(name: str, *, where: str = "policy") -> type[Policy]:
    if not isinstance(name, str) or not name:
        raise PolicyError(f"{where}: expected a policy name, got {name!r}")
    if name in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[name]
    if ":" not in name:
        raise PolicyError(
            f"{where}: unknown policy {name!r}; known: {sorted(BUILTIN_POLICIES)} or 'module:Class'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PolicyError(
            f"{where}: cannot import module {module_name!r} for policy {name!r}: {e}"
        ) from e
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyError(f"{where}: {name!r} is not a subclass of leyline_agent.policies.Policy")
    return cls


def load_policy(
    spec: str | Mapping[str, Any] | Policy, *, where: str = "policy", **knobs: Any
) -> Policy:
    """One policy from a name, a ``{"name": ..., **knobs}`` mapping or an instance."""
    if isinstance(spec, Policy):
        if knobs:
            raise PolicyError(f"{where}: knobs {sorted(knobs)} given for an already built policy")
        return spec
    if isinstance(spec, Mapping):
        spec = dict(spec)
        name = spec.pop("name", None)
        if name is None:
            raise PolicyError(f"{where}.name: missing")
        knobs = {**spec, **knobs}
    else:
        name = spec
    cls = resolve_policy_class(name, where=where)
    try:
        return cls.from_knobs(**knobs)
    except PolicyError as e:
        raise PolicyError(f"{where}: {e}") from e
    except TypeError as e:
        raise PolicyError(f"{where}: bad knobs for {name!r}: {e}") from e


def load_policies(config: str | Path | Mapping[str, Any] | Sequence[Any]) -> list[Policy]:
    """Policies from a YAML path, a ``{"policies": [...]}`` mapping or a list of specs."""
    where = "policies"
    if isinstance(config, (str, Path)) and not _is_spec_name(config):
        path = Path(config)
        try:
            config = yaml.safe_load(path.read_text())
        except OSError as e:
            raise PolicyError(f"{path}: cannot read policy config: {e}") from e
        except yaml.YAMLError as e:
            raise PolicyError(f"{path}: not valid YAML: {e}") from e
        where = f"{path}: policies"
    if isinstance(config, Mapping):
        if "policies" not in config:
            raise PolicyError(f"{where}: a policy config needs a 'policies' list")
        config = config["policies"]
    if isinstance(config, (str, Policy)):
        config = [config]
    if not isinstance(config, Sequence):
        raise PolicyError(f"{where}: expected a list of policies, got {type(config).__name__}")
    return [load_policy(spec, where=f"{where}[{i}]") for i, spec in enumerate(config)]


def _is_spec_name(value: str | Path) -> bool:
    s = str(value)
    return s in BUILTIN_POLICIES or (
        ":" in s and not s.endswith((".yaml", ".yml")) and not Path(s).exists()
    )
