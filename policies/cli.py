"""``leyline policies apply|list``.

    leyline policies apply --policy stale-tool --policy failed-call [--keep 2] < messages.json
    leyline policies apply --config configs/policies/paper.yaml --input messages.json
    leyline policies list

``apply`` reads an OpenAI-style message list (a JSON array, or an object with a
``"messages"`` array, so it accepts its own output) and prints
``{"messages": [...edited...], "edits": [...]}``. Bad input exits 2 naming the message
index or field (``leyline_agent.cli`` maps ``LeylineError`` to exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from leyline_agent.errors import PolicyError, TrajectoryError


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``leyline policies apply|list``."""
    p = sub.add_parser("policies", help="run context policies over a message list")
    verbs = p.add_subparsers(dest="policies_command", metavar="VERB")
    p.set_defaults(func=lambda args: (p.print_help(sys.stderr), 2)[1])

    a = verbs.add_parser("apply", help="apply policies to a message list (JSON on stdin)")
    a.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME",
        help="stale-tool, failed-call or module:Class (repeatable, applied in order)",
    )
    a.add_argument(
        "--config", metavar="YAML", help="policy config file ({policies: [...]}), run first"
    )
    a.add_argument("--keep", type=int, help="override stale-tool's keep")
    a.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="POLICY.KNOB=VALUE",
        help="override a knob, value parsed as YAML (e.g. stale-tool.min_tokens=50)",
    )
    a.add_argument("--input", metavar="FILE", help="read the messages from FILE instead of stdin")
    a.add_argument("--indent", type=int, default=None, help="pretty-print the output JSON")
    a.set_defaults(func=_apply)

    ls = verbs.add_parser("list", help="list the built-in policies and their knobs")
    ls.set_defaults(func=_list)


def _specs(args: argparse.Namespace) -> list[Any]:
    import yaml

    from leyline_agent.policies.registry import load_policies, resolve_policy_class

    specs: list[dict[str, Any]] = []
    if args.config:
        specs += [p.serialize() for p in load_policies(args.config)]
    specs += [{"name": name} for name in args.policy]
    for k, name in enumerate(args.policy):  # an unknown name is the error, whatever follows
        resolve_policy_class(name, where=f"--policy[{k}]")
    if not specs:
        raise PolicyError("--policy: give at least one policy (or --config)")
    for spec in specs:
        if args.keep is not None and spec["name"] == "stale-tool":
            spec["keep"] = args.keep
    for k, item in enumerate(args.set):
        target, eq, value = item.partition("=")
        name, dot, knob = target.rpartition(".")
        if not eq or not dot or not knob:
            raise PolicyError(f"--set[{k}]: {item!r} is not POLICY.KNOB=VALUE")
        hits = [s for s in specs if s["name"] == name]
        if not hits:
            raise PolicyError(f"--set[{k}]: no policy {name!r} selected")
        for s in hits:
            s[knob] = yaml.safe_load(value)
    if args.keep is not None and not any(s["name"] == "stale-tool" for s in specs):
        raise PolicyError("--keep: only applies to the stale-tool policy, which is not selected")
    return specs


def _read_messages(args: argparse.Namespace) -> Any:
    where = args.input or "stdin"
    try:
        text = open(args.input).read() if args.input else sys.stdin.read()  # noqa: SIM115
    except OSError as e:
        raise TrajectoryError(f"--input: cannot read {where}: {e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TrajectoryError(
            f"{where}: not JSON (line {e.lineno}, column {e.colno}): {e.msg}"
        ) from e
    if isinstance(data, dict):
        if "messages" not in data:
            raise TrajectoryError(
                f"{where}: expected a JSON array of messages or an object with 'messages'"
            )
        data = data["messages"]
    return data


def _apply(args: argparse.Namespace) -> int:
    from leyline_agent.policies.pipeline import PolicyPipeline
    from leyline_agent.policies.registry import load_policy

    policies = [load_policy(s, where=f"policy {s['name']!r}") for s in _specs(args)]
    result = PolicyPipeline(policies).apply(_read_messages(args))
    out = {
        "messages": result.messages,
        "edits": [e.model_dump(mode="json", exclude_none=True) for e in result.edits],
    }
    sys.stdout.write(json.dumps(out, ensure_ascii=False, indent=args.indent) + "\n")
    return 0


def _list(args: argparse.Namespace) -> int:  # noqa: ARG001
    from leyline_agent.policies.registry import BUILTIN_POLICIES

    for name, cls in BUILTIN_POLICIES.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"{name:12s} {doc}")
        config = cls.config_class
        if config is not None:
            for knob, f in config.model_fields.items():
                if knob == "patterns":
                    print(
                        f"  {knob} = <{len(f.default)} regexes: traceback, Error:, exit code, ...>"
                    )
                elif knob != "count_tokens":
                    print(f"  {knob} = {f.default!r}")
    print("module:Class  any subclass of leyline_agent.policies.Policy")
    return 0
