"""``SGLangRuntime``: the ``Runtime`` protocol over an embedded ``sglang.Engine``.

Each AMORTIZE directive is three calls (``batch.plan_calls``, run by ``executor``): ``collective_rpc`` of the
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

from typing import Any

from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.namespaces import Namespace, check_session_id
from leyline_agent.sglang_plugin.batch import PREFILL_PARAMS
from leyline_agent.sglang_plugin.executor import DirectiveExecutor
from leyline_agent.sglang_plugin.scheduler_hook import RPC_METHOD, error_from_message
from leyline_agent.wire import DirectivesRequest, DirectivesResponse, StatsResponse

__all__ = ["SGLangRuntime", "model_type_of"]


def model_type_of(tokenizer_manager: Any) -> str | None:
    """The served model's ``model_type`` (its family: ``leyline_agent.families``), if known."""
    config = getattr(getattr(tokenizer_manager, "model_config", None), "hf_config", None)
    return getattr(config, "model_type", None)


class SGLangRuntime:
    """Not thread-safe: one ``apply_directives`` at a time (the scheduler serializes RPCs)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.executor = DirectiveExecutor(self)

    @classmethod
    def launch(cls, model_path: str, **server_kwargs: Any) -> SGLangRuntime:
        """Start an embedded ``sglang.Engine`` with the plugin (page size 1, RadixCache)."""
        from leyline_agent.sglang_plugin.launch import require_full_sglang
        from leyline_agent.sglang_plugin.radix_backend import RADIX_CACHE_BACKEND

        require_full_sglang()
        import sglang

        kwargs = {"page_size": 1, "radix_cache_backend": RADIX_CACHE_BACKEND, **server_kwargs}
        return cls(sglang.Engine(model_path=model_path, **kwargs))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer_manager.tokenizer

    @property
    def model_type(self) -> str | None:
        return model_type_of(self.engine.tokenizer_manager)

    @property
    def counters(self) -> Any:
        return self.executor.counters

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
        key = Namespace(session=sid).key
        return self.engine.loop.run_until_complete(
            self._request(input_ids, sampling_params or {}, key)
        )

    def apply_directives(self, request: DirectivesRequest) -> DirectivesResponse:
        return self.engine.loop.run_until_complete(self.executor.execute(request))

    def stats(self) -> StatsResponse:
        return self.counters.to_stats()

    # -- the executor's transport ---------------------------------------------------------
    async def prefill(self, token_ids: list[int], extra_key: str) -> None:
        await self._request(token_ids, PREFILL_PARAMS, extra_key)

    async def rpc(self, method: str, kwargs: dict[str, Any]) -> None:
        self.call_rpc(kwargs, method)

    async def _request(self, input_ids: list[int], params: dict[str, Any], extra_key: str) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=list(input_ids), sampling_params=dict(params), extra_key=extra_key
        )
        return await self.engine.tokenizer_manager.generate_request(obj, None).__anext__()

    def call_rpc(self, kwargs: dict[str, Any], method: str = RPC_METHOD) -> None:
        """``collective_rpc`` of ``method`` on every scheduler rank; a failure raises the
        Leyline error it carried."""
        try:
            self.engine.collective_rpc(method, **kwargs)
        except AssertionError as e:  # Engine.collective_rpc asserts success with the message
            err = error_from_message(str(e))
            if err is not None:
                raise err from e
            raise RuntimeUnavailableError(f"{method} failed in the scheduler: {e}") from e
