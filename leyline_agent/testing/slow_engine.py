"""A real engine whose tokens arrive late: streams and generations that are surely still
running when a test's client leaves or another request arrives."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["SlowTokens"]


class SlowTokens:
    """Wraps an engine; each token reaches its ``on_token`` ``delay_s`` late (the engine
    itself, and everything else it does, unchanged)."""

    def __init__(self, engine: Any, delay_s: float = 0.01) -> None:
        self._engine, self._delay_s = engine, delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt_ids: Any, params: Any, on_token: Any = None, **kw: Any) -> Any:
        def slow(*args: Any) -> None:
            time.sleep(self._delay_s)
            if on_token is not None:
                on_token(*args)

        return self._engine.generate(prompt_ids, params, on_token=slow, **kw)
