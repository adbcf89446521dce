"""``leyline bench http``: the HTTP agent replay against any OpenAI-compatible endpoint.

The replay, table and files are ``side_by_side``'s; here the server is one already running,
named by its URL, and the arms are the ones it supports (``splice`` needs ``/leyline/v1``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..options import standalone
from .mechanism import POLICIES
from .side_by_side import add_replay_arguments, markdown, replay_set, run_target, write_rows

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8080/v1")
    p.add_argument("--served-model", required=True, help="the model name the endpoint serves")
    p.add_argument("--label", default="endpoint", help="name of the endpoint in the table")
    p.add_argument("--arms", default="radix", help="radix, splice (needs /leyline/v1), full")
    add_replay_arguments(p)
    p.add_argument("--out", type=Path, default=Path("runs/http"), help="output folder")


def main(args: argparse.Namespace) -> int:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    trajs = replay_set(args.trajectories, args.quick)
    rows = run_target(args.label, args.base_url, args.served_model, arms, args.concurrency, trajs,
                      args.sessions, args.max_turns or (6 if args.quick else None))  # fmt: skip
    write_rows(rows, args.out, {"base_url": args.base_url, "args": vars(args), "policies": POLICIES})
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
