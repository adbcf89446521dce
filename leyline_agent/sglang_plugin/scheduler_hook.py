"""How the splice reaches every scheduler rank: ``Engine.collective_rpc("leyline_splice", ...)``.

SGLang's ``Scheduler.handle_rpc_request`` calls ``getattr(scheduler, method)(**parameters)``
on every TP rank (rank 0 receives the request and broadcasts it), then barriers, and answers
``RpcReqOutput(success, message=str(exception))``. ``RpcReqInput.parameters`` holds flat
scalars only (``bool | int | float | str | None``), so token lists travel as JSON strings.

Every RPC names the radix namespace of the session it acts for (``namespace``: a
``Namespace(...).key``, see ``routing.py``): ``leyline_lookup`` (how much of the base is
cached: what ``directives.pipeline.decide`` is given), ``leyline_check`` and
``leyline_splice`` for AMORTIZE, ``leyline_forget`` (drop the session's rows of ``T'`` from
the span on) before a FORGET's normal prefill.

An answer rides back in ``RpcReqOutput.message``: SGLang answers an RPC with success or the
failure's message only, so a method that has one leaves it on the scheduler
(``ANSWER_ATTR``) and ``around_rpc_request`` (an ``AROUND`` hook on
``Scheduler.handle_rpc_request``) puts it in the successful answer's message, which is
empty otherwise. ``answer_of`` reads an ``RpcReqOutput`` on the caller's side.

``install`` (run by the plugin after ``Scheduler.__init__``) binds the four methods on the
scheduler instance. Every TP rank holds its own replica of the tree (the ranks make the same
decisions in lockstep) and of the MLA latent cache (or its shard of the KV heads for MHA):
each rank splices its own, with the same slot indices.

A failure is re-raised as ``SpliceRpcError("leyline:<ErrorClass>: message")`` so that the
caller (``client.py``) can give back the same Leyline error class on its side.
"""

from __future__ import annotations

import json
import types
from typing import Any

from leyline_agent.directives import Directive
from leyline_agent.errors import DirectiveError, LeylineError, RuntimeUnavailableError
from leyline_agent.namespaces import ANONYMOUS

_ANONYMOUS_KEY = ANONYMOUS.key

__all__ = [
    "ANSWER_ATTR",
    "RPC_CHECK",
    "RPC_FLUSH",
    "RPC_FORGET",
    "RPC_LOOKUP",
    "RPC_METHOD",
    "SpliceRpcError",
    "answer_of",
    "around_rpc_request",
    "decode_splice_kwargs",
    "encode_lookup_kwargs",
    "encode_splice_kwargs",
    "install",
    "leyline_check",
    "leyline_flush",
    "leyline_forget",
    "leyline_lookup",
    "leyline_splice",
    "target_of",
]

RPC_METHOD = "leyline_splice"
RPC_CHECK = "leyline_check"
RPC_FORGET = "leyline_forget"
RPC_LOOKUP = "leyline_lookup"
RPC_FLUSH = "leyline_flush"
ANSWER_ATTR = "leyline_rpc_answer"  # where a method leaves its answer for the RPC's reply
_ERROR_PREFIX = "leyline:"


class SpliceRpcError(RuntimeError):
    """Carries a Leyline error across the RPC boundary as ``leyline:<Class>: message``."""


def encode_splice_kwargs(
    tokens: list[int], directive: Directive, namespace: str = _ANONYMOUS_KEY
) -> dict[str, str | int]:
    """Flat scalars for ``collective_rpc``: token lists as compact JSON strings."""
    if not isinstance(directive.replacement, list):
        raise DirectiveError("directive.replacement: text must be compiled to token ids first")
    return {
        "tokens_json": json.dumps([int(t) for t in tokens], separators=(",", ":")),
        "start": int(directive.start),
        "end": int(directive.end),
        "replacement_json": json.dumps(directive.replacement, separators=(",", ":")),
        "mode": directive.mode.value,
        "namespace": namespace,
    }


def encode_lookup_kwargs(tokens: list[int], namespace: str = _ANONYMOUS_KEY) -> dict[str, str]:
    """``leyline_lookup``'s flat scalars: the base as a compact JSON string, the namespace."""
    return {
        "tokens_json": json.dumps([int(t) for t in tokens], separators=(",", ":")),
        "namespace": namespace,
    }


def _token_list(text: Any, field: str) -> list[int]:
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError as e:
        raise DirectiveError(f"{field}: not valid JSON ({e.msg} at {e.pos})") from e
    if not isinstance(value, list):
        raise DirectiveError(f"{field}: must be a JSON list of token ids")
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise DirectiveError(f"{field}[{i}]: {t!r} is not a token id")
    return value


def decode_splice_kwargs(
    *,
    tokens_json: Any,
    start: Any,
    end: Any,
    replacement_json: Any,
    mode: Any = "amortize",
    namespace: Any = _ANONYMOUS_KEY,
) -> tuple[list[int], Directive, str]:
    from leyline_agent.sglang_plugin.routing import check_namespace

    tokens = _token_list(tokens_json, "tokens_json")
    replacement = _token_list(replacement_json, "replacement_json")
    directive = Directive.parse(
        {"start": start, "end": end, "replacement": replacement, "mode": mode}, where="directive"
    )
    return tokens, directive, check_namespace(namespace)


def target_of(scheduler: Any) -> Any:
    """The ``SpliceTarget`` of one scheduler rank (its tree, allocator, KV pool, RoPE spec)."""
    from leyline_agent.kernels import RopeSpec
    from leyline_agent.sglang_plugin.splice import SpliceTarget

    spec = getattr(scheduler, "_leyline_rope_spec", None)
    if spec is None:
        spec = RopeSpec.from_hf_config(scheduler.model_config.hf_config, cache_owner="sglang")
        scheduler._leyline_rope_spec = spec
    allocator = scheduler.token_to_kv_pool_allocator
    return SpliceTarget(
        tree=scheduler.tree_cache, allocator=allocator, kv_pool=allocator.get_kvcache(), spec=spec
    )


def _run_rpc(scheduler: Any, op: Any, kwargs: dict[str, Any]) -> None:
    """Decode the flat RPC arguments, run ``op(target, tokens, directive, namespace)`` on
    this rank; a Leyline error travels back as ``leyline:<ErrorClass>: message``."""
    try:
        tokens, directive, namespace = decode_splice_kwargs(**kwargs)
        op(target_of(scheduler), tokens, directive, namespace)
    except LeylineError as e:
        raise SpliceRpcError(f"{_ERROR_PREFIX}{type(e).__name__}: {e}") from e


def leyline_splice(scheduler: Any, **kwargs: Any) -> None:
    """The RPC method: AMORTIZE-splice ``tokens`` on this rank's tree and pool, ``T'`` into
    the session's namespace (keywords: ``encode_splice_kwargs``)."""
    from leyline_agent.sglang_plugin.splice import splice_amortize

    def op(target: Any, tokens: list[int], directive: Any, namespace: str) -> None:
        _sync(target.kv_pool)
        splice_amortize(target, tokens, directive, namespace)
        _sync(target.kv_pool)

    _run_rpc(scheduler, op, kwargs)


def leyline_lookup(scheduler: Any, *, tokens_json: Any, namespace: Any = _ANONYMOUS_KEY) -> None:
    """The RPC method: how many leading tokens of the base a directive of ``namespace``
    finds cached (``splice.cached_length``), read-only; answered as
    ``{"cached_tokens": n}`` (``around_rpc_request``)."""
    from leyline_agent.sglang_plugin.routing import check_namespace
    from leyline_agent.sglang_plugin.splice import cached_length
    from leyline_agent.sglang_plugin.treeview import check_tree

    try:
        tokens = _token_list(tokens_json, "tokens_json")
        ns = check_namespace(namespace)
        check_tree(scheduler.tree_cache)
        n = cached_length(scheduler.tree_cache, tokens, ns)
    except LeylineError as e:
        raise SpliceRpcError(f"{_ERROR_PREFIX}{type(e).__name__}: {e}") from e
    setattr(scheduler, ANSWER_ATTR, json.dumps({"cached_tokens": n}))


def leyline_flush(scheduler: Any) -> None:
    """The RPC method: every cached row no request holds is evicted, in every namespace
    (SGLang serves one tenant); answered as ``{"flushed_tokens": n, "kept_tokens": m}``,
    ``m`` the rows requests in flight still lock."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from leyline_agent.sglang_plugin.treeview import check_tree

    tree = scheduler.tree_cache
    try:
        check_tree(tree)
    except LeylineError as e:
        raise SpliceRpcError(f"{_ERROR_PREFIX}{type(e).__name__}: {e}") from e
    freed = tree.evict(EvictParams(num_tokens=tree.evictable_size())).num_tokens_evicted
    kept = tree.evictable_size() + tree.protected_size()
    setattr(scheduler, ANSWER_ATTR, json.dumps({"flushed_tokens": freed, "kept_tokens": kept}))


def around_rpc_request(original: Any, scheduler: Any, recv_req: Any, *args: Any) -> Any:
    """``HookType.AROUND`` on ``Scheduler.handle_rpc_request``: SGLang runs the method (and
    its barrier) as always; an answer the method left on the scheduler goes into the
    successful reply's message, and never outlives its RPC."""
    setattr(scheduler, ANSWER_ATTR, None)
    try:
        out = original(scheduler, recv_req, *args)
        answer = getattr(scheduler, ANSWER_ATTR, None)
    finally:
        setattr(scheduler, ANSWER_ATTR, None)
    if answer is not None and out.success:
        out.message = answer
    return out


def answer_of(out: Any, method: str) -> str:
    """The caller's side of an ``RpcReqOutput``: the method's answer (empty if it has none),
    or the Leyline error its failure carried (else ``RuntimeUnavailableError``)."""
    if out.success:
        return str(out.message or "")
    err = error_from_message(out.message)
    if err is not None:
        raise err
    raise RuntimeUnavailableError(f"{method} failed in the scheduler: {out.message}")


def leyline_check(scheduler: Any, **kwargs: Any) -> None:
    """The read-only RPC sent before the head's prefill: fail early, change nothing."""
    from leyline_agent.sglang_plugin.splice import check_splice_base

    _run_rpc(scheduler, check_splice_base, kwargs)


def leyline_forget(scheduler: Any, **kwargs: Any) -> None:
    """The RPC sent before a FORGET's prefill: drop the session's rows of ``T'`` from the
    span on (``forget.py``), so the prefill computes them afresh."""
    from leyline_agent.sglang_plugin.forget import forget_rows

    def op(target: Any, tokens: list[int], directive: Any, namespace: str) -> None:
        _sync(target.kv_pool)  # in-flight forwards may still read the rows being freed
        forget_rows(target, tokens, directive, namespace)

    _run_rpc(scheduler, op, kwargs)


def _sync(pool: Any) -> None:
    """Order the splice after in-flight forwards (overlap scheduling) and before the next."""
    import torch

    device = getattr(pool, "device", "cpu")
    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def install(scheduler: Any) -> None:
    """Bind the RPC methods on a scheduler instance (the RPC looks them up with getattr)."""
    scheduler.leyline_splice = types.MethodType(leyline_splice, scheduler)
    scheduler.leyline_check = types.MethodType(leyline_check, scheduler)
    scheduler.leyline_forget = types.MethodType(leyline_forget, scheduler)
    scheduler.leyline_lookup = types.MethodType(leyline_lookup, scheduler)
    scheduler.leyline_flush = types.MethodType(leyline_flush, scheduler)


def after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """``HookType.AFTER`` hook on ``Scheduler.__init__``."""
    install(scheduler)
    return None


def error_from_message(message: str) -> LeylineError | None:
    """Turn an RPC failure message back into the Leyline error it carried (None if foreign)."""
    import leyline_agent.errors as errors

    idx = message.find(_ERROR_PREFIX)
    if idx < 0:
        return None
    name, _, text = message[idx + len(_ERROR_PREFIX) :].partition(": ")
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, LeylineError)):
        cls = LeylineError
    return cls(text)
