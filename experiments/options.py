"""What the verbs' options share: argument types, and a verb module run on its own.

A verb module (``experiments/cli.py``'s table names each) has ``add_arguments(parser)`` and
``main(args) -> int``; ``parse`` builds its parser outside the CLI (another verb calling it,
``python -m leyline_agent.experiments.bench.bench_splice ...``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

AddArguments = Callable[[argparse.ArgumentParser], None]


def csv_ints(text: str) -> list[int]:
    """``"1,4,8"`` as ``[1, 4, 8]``: integers >= 1, at least one."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse(
    add_arguments: AddArguments, argv: Sequence[str] | None = None, prog: str | None = None
) -> argparse.Namespace:
    """``argv`` (default: the command line) parsed by the verb's own options."""
    ap = argparse.ArgumentParser(prog=prog)
    add_arguments(ap)
    return ap.parse_args(argv)


def standalone(add_arguments: AddArguments, main: Callable[[argparse.Namespace], int]) -> int:
    """A verb module's ``__main__``: its options from the command line, then ``main``."""
    return int(main(parse(add_arguments)) or 0)
