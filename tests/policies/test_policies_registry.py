"""load_policy / load_policies: names, module:Class, YAML configs, and every bad spec."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from leyline_agent.errors import PolicyError
from leyline_agent.policies import (
    FailedCallDetector,
    StaleToolTruncation,
    load_policies,
    load_policy,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "policies"

CUSTOM = textwrap.dedent(
    '''
    from typing import ClassVar
    from leyline_agent.directives import MessageEdit
    from leyline_agent.policies import Policy

    class Shorten(Policy):
        """Cut every tool result to max_chars."""
        name: ClassVar[str] = "shorten"

        def __init__(self, max_chars: int = 10):
            self.max_chars = max_chars

        def edits(self, trajectory):
            return [
                MessageEdit(index=i, content=trajectory.text(i)[: self.max_chars], policy=self.name)
                for i in trajectory.result_of
                if len(trajectory.text(i)) > self.max_chars
            ]

    class NotAPolicy:
        pass
    '''
)


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_policies_mod.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_policies_mod"


def test_builtin_names_and_knobs():
    p = load_policy("stale-tool")
    assert isinstance(p, StaleToolTruncation) and p.config.keep == 2
    p = load_policy({"name": "stale-tool", "keep": 4, "exclude_tools": ["view"]})
    assert p.config.keep == 4 and p.config.exclude_tools == ("view",)
    assert load_policy("stale-tool", keep=3).config.keep == 3
    assert isinstance(load_policy("failed-call", after=2), FailedCallDetector)
    inst = FailedCallDetector()
    assert load_policy(inst) is inst


def test_module_class(custom_module):
    p = load_policy(f"{custom_module}:Shorten", max_chars=3)
    assert p.name == "shorten" and p.max_chars == 3
    [q] = load_policies([{"name": f"{custom_module}:Shorten", "max_chars": 5}])
    assert q.max_chars == 5


def test_yaml_configs_shipped_in_configs_load(tmp_path):
    files = sorted(CONFIGS.glob("*.yaml"))
    assert {f.name for f in files} >= {"paper.yaml", "stale+failed.yaml"}
    for f in files:
        policies = load_policies(f)
        assert policies and all(hasattr(p, "edits") for p in policies)
    [paper] = load_policies(CONFIGS / "paper.yaml")
    assert isinstance(paper, StaleToolTruncation) and paper.config.keep == 2
    assert [type(p) for p in load_policies(str(CONFIGS / "stale+failed.yaml"))] == [
        StaleToolTruncation,
        FailedCallDetector,
    ]


def test_serialize_then_load_rebuilds_the_same_policy():
    for p in [
        StaleToolTruncation(keep=3, min_tokens=7, clear_inputs=True),
        FailedCallDetector(after=2),
    ]:
        q = load_policy(p.serialize())
        assert type(q) is type(p) and q.serialize() == p.serialize()


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("stale_tool", "unknown policy 'stale_tool'"),
        ("", "expected a policy name"),
        ({"keep": 2}, r"policy\.name: missing"),
        ({"name": "stale-tool", "keep": 0}, r"stale-tool\.keep"),
        ({"name": "failed-call", "patterns": ["(unclosed"]}, r"failed-call\.patterns"),
        ("no_such_module_xyz:Thing", "cannot import module 'no_such_module_xyz'"),
        ("os:path", "is not a subclass"),
    ],
)
def test_bad_specs(spec, needle):
    with pytest.raises(PolicyError, match=needle):
        load_policy(spec)


def test_bad_custom_specs(custom_module):
    with pytest.raises(PolicyError, match="is not a subclass"):
        load_policy(f"{custom_module}:NotAPolicy")
    with pytest.raises(PolicyError, match="is not a subclass"):
        load_policy(f"{custom_module}:Missing")
    with pytest.raises(PolicyError, match="bad knobs"):
        load_policy(f"{custom_module}:Shorten", width=3)


def test_bad_configs(tmp_path):
    with pytest.raises(PolicyError, match="cannot read"):
        load_policies(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies: [stale-tool\n")
    with pytest.raises(PolicyError, match="not valid YAML"):
        load_policies(bad)
    nolist = tmp_path / "nolist.yaml"
    nolist.write_text("keep: 2\n")
    with pytest.raises(PolicyError, match="needs a 'policies' list"):
        load_policies(nolist)
    knob = tmp_path / "knob.yaml"
    knob.write_text("policies:\n  - name: stale-tool\n  - name: stale-tool\n    keep: -1\n")
    with pytest.raises(PolicyError, match=r"policies\[1\].*stale-tool\.keep"):
        load_policies(knob)
    with pytest.raises(PolicyError, match="expected a list"):
        load_policies({"policies": 3})
