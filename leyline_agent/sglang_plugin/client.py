"""``SGLangRuntime``: the ``Runtime`` protocol over an embedded ``sglang.Engine``.

Each AMORTIZE directive is three calls (``batch.plan_steps``): ``collective_rpc`` of the
read-only ``leyline_check`` (base cached far enough? fails before anything changes), a
normal generate request for the head (SGLang's own prefill caches ``T[:s] + R``), then
``collective_rpc`` of ``leyline_splice`` on every scheduler rank. ``collective_rpc`` answers only success or the
failure's message; the plugin's errors travel as ``leyline:<Class>: message`` and are
raised here as the same class. Needs CUDA and a full SGLang install (``launch``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from leyline_agent.errors import CacheMissError, LeylineError, RuntimeUnavailableError
from leyline_agent.sglang_plugin.batch import (
    PREFILL_PARAMS,
    compile_request,
    plan_steps,
    response_for,
)
from leyline_agent.sglang_plugin.scheduler_hook import RPC_CHECK, RPC_METHOD, error_from_message
from leyline_agent.wire import DirectivesRequest, DirectivesResponse, StatsResponse

__all__ = ["SGLangRuntime", "SpliceCounters"]


@dataclass(slots=True)
class SpliceCounters:
    splices: dict[str, int] = field(default_factory=lambda: {"amortize": 0, "forget": 0})
    rotated_tokens: int = 0
    prefilled_tokens: int = 0
    fallbacks: int = 0
    directive_errors: int = 0

    def add(self, resp: DirectivesResponse) -> None:
        for k, v in resp.splices.items():
            self.splices[k] = self.splices.get(k, 0) + v
        self.rotated_tokens += resp.rotated_tokens
        self.prefilled_tokens += resp.prefilled_tokens
        self.fallbacks += int(resp.fallback)

    def stats(self) -> StatsResponse:
        return StatsResponse(
            splices=dict(self.splices),
            rotated_tokens=self.rotated_tokens,
            prefilled_tokens=self.prefilled_tokens,
            fallbacks=self.fallbacks,
            directive_errors=self.directive_errors,
        )


class SGLangRuntime:
    """Not thread-safe: one ``apply_directives`` at a time (the scheduler serializes RPCs)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.counters = SpliceCounters()

    @classmethod
    def launch(cls, model_path: str, **server_kwargs: Any) -> SGLangRuntime:
        """Start an embedded ``sglang.Engine`` with the plugin (page size 1, RadixCache)."""
        from leyline_agent.sglang_plugin import RADIX_CACHE_BACKEND
        from leyline_agent.sglang_plugin.launch import require_full_sglang

        require_full_sglang()
        import sglang

        kwargs = {"page_size": 1, "radix_cache_backend": RADIX_CACHE_BACKEND, **server_kwargs}
        return cls(sglang.Engine(model_path=model_path, **kwargs))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer_manager.tokenizer

    def apply_directives(self, request: DirectivesRequest) -> DirectivesResponse:
        t0 = time.perf_counter()
        try:
            tokens, directives = compile_request(request, self.tokenizer)
            steps = plan_steps(tokens, directives)
        except LeylineError:
            self.counters.directive_errors += 1
            raise
        try:
            for st in steps:
                if st.rpc_kwargs is not None:  # read-only: fail before prefilling anything
                    self.rpc(st.rpc_kwargs, RPC_CHECK)
                self.engine.generate(input_ids=st.prefill_ids, sampling_params=PREFILL_PARAMS)
                if st.rpc_kwargs is not None:
                    self.rpc(st.rpc_kwargs, RPC_METHOD)
            resp = response_for(steps, tokens)
        except CacheMissError:
            if not request.fallback:
                self.counters.directive_errors += 1
                raise
            resp = response_for(steps, tokens, fallback=True)
        except LeylineError:
            self.counters.directive_errors += 1
            raise
        resp = resp.model_copy(update={"elapsed_s": time.perf_counter() - t0})
        self.counters.add(resp)
        return resp

    def rpc(self, kwargs: dict[str, Any], method: str = RPC_METHOD) -> None:
        try:
            self.engine.collective_rpc(method, **kwargs)
        except AssertionError as e:  # Engine.collective_rpc asserts success with the message
            err = error_from_message(str(e))
            if err is not None:
                raise err from e
            raise RuntimeUnavailableError(f"{method} failed in the scheduler: {e}") from e

    def stats(self) -> StatsResponse:
        return self.counters.stats()
