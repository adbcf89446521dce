"""``SGLangRuntime``: the ``Runtime`` protocol over an embedded ``sglang.Engine``.

A request's base is looked up first (``leyline_lookup``, run by ``executor``); then each
AMORTIZE directive is three calls (``batch.plan_calls``): the read-only ``leyline_check``
(base still cached far enough? fails before anything changes), a normal generate request
for the head (SGLang's own prefill caches ``T[:s] + R``), then ``leyline_splice`` on every
scheduler rank. A FORGET is ``leyline_forget`` then a normal request for ``T'``. The RPCs
go over the engine's RPC socket as ``Engine.collective_rpc`` sends them, but the reply is
read here: it carries ``leyline_lookup``'s answer (``scheduler_hook.answer_of``), and a
failure's ``leyline:<Class>: message`` is raised as the same class. Needs CUDA and a full
SGLang install (``launch``).

Sessions: a directive request's ``session`` names the namespace its splices go to
(``routing.py``); ``generate(..., session=id)`` sends a request of that session, with its
extra key, so it is served the session's spliced rows. ``Engine.generate`` has no
``extra_key`` argument in 0.5.23, so both build SGLang's ``GenerateReqInput`` themselves and
run it on the engine's event loop, as ``Engine.generate`` does.
"""

from __future__ import annotations

from typing import Any

from leyline_agent.directives.service import DirectiveService, ServedModel
from leyline_agent.directives.validate import RequestLimits, longest_token_bytes
from leyline_agent.families import chat_format, token_id
from leyline_agent.namespaces import Namespace, check_session_id, named_namespace
from leyline_agent.sglang_plugin.batch import PREFILL_PARAMS
from leyline_agent.sglang_plugin.executor import SGLangBackend
from leyline_agent.sglang_plugin.scheduler_hook import RPC_METHOD, answer_of
from leyline_agent.wire import DirectivesRequest, DirectivesResponse, StatsResponse

__all__ = ["SGLangRuntime", "directive_service", "model_type_of", "vocab_size_of"]


def _hf_config(tokenizer_manager: Any) -> Any:
    return getattr(getattr(tokenizer_manager, "model_config", None), "hf_config", None)


def model_type_of(tokenizer_manager: Any) -> str | None:
    """The served model's ``model_type`` (its family: ``leyline_agent.families``), if known."""
    return getattr(_hf_config(tokenizer_manager), "model_type", None)


def vocab_size_of(tokenizer_manager: Any) -> int:
    """The served model's vocabulary (token ids are checked against it): its config's, else
    the tokenizer's."""
    size = getattr(_hf_config(tokenizer_manager), "vocab_size", None)
    return int(size) if isinstance(size, int) else len(tokenizer_manager.tokenizer)


def directive_service(tokenizer_manager: Any) -> DirectiveService:
    """The ``DirectiveService`` of the model ``tokenizer_manager`` serves: its served name
    (else its path), vocabulary, context length and chat format."""
    tm = tokenizer_manager
    tokenizer = tm.tokenizer
    name = getattr(tm, "served_model_name", None) or getattr(tm, "model_path", None) or ""
    context = getattr(tm, "context_len", None)
    limits = RequestLimits(
        vocab_size=vocab_size_of(tm),
        max_prompt_tokens=context if isinstance(context, int) else None,
        longest_token_bytes=longest_token_bytes(tokenizer),
    )
    boundary = token_id(tokenizer, chat_format(model_type_of(tm)).message_boundary)
    return DirectiveService(ServedModel(str(name), tokenizer, limits, boundary))


class SGLangRuntime:
    """Not thread-safe: one ``apply_directives`` at a time (the scheduler serializes RPCs)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.backend = SGLangBackend(self)
        self.service = directive_service(engine.tokenizer_manager)

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
    def counters(self) -> Any:
        return self.backend.counters

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
        """``request`` through the ``DirectiveService`` (its errors raised as they are)."""
        body = request.model_dump(mode="json", exclude_unset=True)
        req, ns = self.service.admit(body, lambda s: named_namespace(s, None))
        return self.engine.loop.run_until_complete(self.service.run(req, ns, self.backend))

    def stats(self) -> StatsResponse:
        return self.counters.to_stats()

    # -- the backend's transport ---------------------------------------------------------
    async def prefill(self, token_ids: list[int], extra_key: str) -> None:
        await self._request(token_ids, PREFILL_PARAMS, extra_key)

    async def rpc(self, method: str, kwargs: dict[str, Any]) -> str:
        return self.call_rpc(kwargs, method)

    async def _request(self, input_ids: list[int], params: dict[str, Any], extra_key: str) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=list(input_ids), sampling_params=dict(params), extra_key=extra_key
        )
        return await self.engine.tokenizer_manager.generate_request(obj, None).__anext__()

    def call_rpc(self, kwargs: dict[str, Any], method: str = RPC_METHOD) -> str:
        """``method`` on every scheduler rank, sent as ``Engine.collective_rpc`` sends it;
        its answer (empty if it has none), or the Leyline error its failure carried."""
        import zmq
        from sglang.srt.managers.io_struct import RpcReqInput, sock_recv, sock_send

        sock = self.engine.send_to_rpc
        sock_send(sock, RpcReqInput(method=method, parameters=kwargs))
        return answer_of(sock_recv(sock, flags=zmq.BLOCKY), method)
