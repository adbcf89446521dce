"""CLI verbs of this layer (placeholder: filled in by the layer's owner)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:  # noqa: ARG001
    """Add this layer's verbs to the ``leyline`` parser."""
