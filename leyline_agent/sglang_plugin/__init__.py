"""SGLang integration (placeholder: filled in by its owner)."""


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group."""
