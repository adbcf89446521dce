"""``SGLangRuntime``: the ``Runtime`` protocol over an embedded ``sglang.Engine``.

Each AMORTIZE directive is three calls (``batch.plan_steps``): ``collective_rpc`` of the
read-only ``leyline_check`` (base cached far enough? fails before anything changes), a
normal generate request for the head (SGLang's own prefill caches ``T[:s] + R``), then
``collective_rpc`` of ``leyline_splice`` on every scheduler rank. A FORGET is
``leyline_forget`` then a normal request for ``T'``. ``collective_rpc`` answers only success
or the failure's message; the plugin's errors travel as ``leyline:<Class>: message`` and
are raised here as the same class. Needs CUDA and a full SGLang install (``launch``).

Sessions: a directive request's ``session`` names the namespace its splices go to
(``routing.py``); ``generate(..., session=id)`` sends a request of that session, with its
extra key, so it is served the session's spliced rows. ``Engine.generate`` has no
``extra_key`` argument in 0.5.23, so both build SGLang's ``GenerateReqInput`` themselves and
run it on the engine's event loop, as ``Engine.generate`` does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from leyline_agent.errors import CacheMissError, LeylineError, RuntimeUnavailableError
from leyline_agent.namespaces import Namespace, check_session_id
from leyline_agent.sglang_plugin.batch import (
    PREFILL_PARAMS,
    compile_request,
    plan_steps,
    response_for,
)
from leyline_agent.sglang_plugin.routing import request_namespace
from leyline_agent.sglang_plugin.scheduler_hook import RPC_METHOD, error_from_message
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

    def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        session: str | None = None,
    ) -> Any:
        """One generate request of ``session`` (``None``: the anonymous session); SGLang's
        output dict, as ``Engine.generate`` returns it."""
        sid = check_session_id(session, "session")
        return self._submit(input_ids, sampling_params or {}, Namespace(session=sid).key)

    def apply_directives(self, request: DirectivesRequest) -> DirectivesResponse:
        t0 = time.perf_counter()
        try:
            key = request_namespace(request.session, None).key
            tokens, directives = compile_request(request, self.tokenizer)
            steps = plan_steps(tokens, directives, key)
        except LeylineError:
            self.counters.directive_errors += 1
            raise
        try:
            for st in steps:
                self.rpc(st.rpc_kwargs, st.rpc_before)  # check: fails before any prefill
                self._submit(st.prefill_ids, PREFILL_PARAMS, key)
                if st.rpc_after is not None:
                    self.rpc(st.rpc_kwargs, st.rpc_after)
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

    def _submit(self, input_ids: list[int], params: dict[str, Any], extra_key: str) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=list(input_ids), sampling_params=dict(params), extra_key=extra_key
        )
        gen = self.engine.tokenizer_manager.generate_request(obj, None)
        return self.engine.loop.run_until_complete(gen.__anext__())

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
