"""Every option of every ``leyline`` command has help text, and a non-trivial default is
shown in ``--help`` (checked on the real parser and on its formatted help); every verb of the
experiments' table parses its options and has a run."""

from __future__ import annotations

import argparse

from leyline_agent.cli import build_parser
from leyline_agent.experiments.cli import load


def _parsers(parser: argparse.ArgumentParser, name: str = "leyline"):
    load(parser)  # a verb's options come from its module when it is chosen
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


def test_every_option_has_help_and_its_default() -> None:
    problems = []
    for name, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for a in parser._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not a.help:
                problems.append(f"{name} {a.option_strings}: no help")
                continue
            shown = formatter._get_help_string(a) or ""  # what --help prints for it
            d = a.default
            if d not in (None, False, argparse.SUPPRESS) and d != [] and "default" not in shown:
                problems.append(f"{name} {a.option_strings}: default {d!r} not shown")
        parser.format_help()  # formats (no stray '%' in any help text)
    assert problems == []


def test_bench_commands_take_their_flags() -> None:
    """``leyline bench engine --contexts ...`` as the README writes it (a REMAINDER argument
    once refused every leading flag)."""
    a = build_parser().parse_args(["bench", "engine", "--contexts", "512,8192", "--decode", "4"])
    assert (a.contexts, a.decode, a.clients) == ("512,8192", 4, 8)
    a = build_parser().parse_args(["bench", "serve", "--clients", "1,8", "--phases", "cached"])
    assert (a.clients, a.phases) == ([1, 8], "cached")


def test_every_verb_of_the_table_is_a_module_with_its_options_and_a_run() -> None:
    from leyline_agent.experiments.cli import VERBS

    parser = build_parser()
    for verb in VERBS:
        group = parser
        for word in verb.words:
            sub = next(a for a in group._actions if isinstance(a, argparse._SubParsersAction))
            group = sub.choices[word]
        load(group)
        assert callable(group.get_default("func")), verb.words
    args = parser.parse_args(["bench", "soak", "--model", "m", "--rounds", "2"])
    assert (args.model, args.rounds, args.clients) == ("m", 2, 64)
