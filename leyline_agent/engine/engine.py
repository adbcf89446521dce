"""The embedded engine: transformers model + KV pool + radix prefix cache + splices.

Engine facade. Thread-safe: concurrent ``generate`` calls share batched steps
(``stepper.py``); every other operation runs between two steps, under the engine lock.

- ``generate``: longest cached prefix (at most ``len(prompt) - 1`` tokens: the last prompt
  token is always recomputed for its logits), prefill the rest, decode, then cache
  ``prompt + output`` (the last output token is forwarded once more so the whole sequence,
  which the agent's next turn repeats, is in the cache).
- ``apply_directives``: execute a token-form or message-form request (``executor.py``).
- ``stats``: cumulative counters (``leyline_agent.wire.StatsResponse``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from leyline_agent.engine import sequence
from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.cache.kv_pool import KVLayout, KVPool
from leyline_agent.engine.cache.prefix_cache import PrefixCache
from leyline_agent.engine.checkpoints.toy_tokenizer import EOS, IM_END, IM_START
from leyline_agent.engine.model.loader import load
from leyline_agent.engine.model.runner import ModelRunner
from leyline_agent.engine.params import GenerationResult, InvalidRequestError, SamplingParams
from leyline_agent.engine.sampler import Sampler, StopMatcher
from leyline_agent.engine.stepper import Stepper
from leyline_agent.errors import TrajectoryError
from leyline_agent.namespaces import ANONYMOUS, DEFAULT_TENANT, Namespace
from leyline_agent.wire import DirectivesRequest, DirectivesResponse, StatsResponse

__all__ = ["Engine", "EngineStats", "GenerationResult", "InvalidRequestError", "SamplingParams"]

log = structlog.get_logger(__name__)

_ROLES = {"system", "user", "assistant", "tool"}


@dataclass(slots=True)
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    splices: dict[str, int] = field(default_factory=lambda: {"amortize": 0, "forget": 0})
    rotated_tokens: int = 0
    fallbacks: int = 0
    directive_errors: int = 0


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str = "leyline",
        cache_budget_tokens: int = 65536,
        prefix_cache: bool = True,
        pin_ttl_s: float = 300.0,
    ) -> None:
        from leyline_agent.kernels import RopeSpec

        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(self.config.vocab_size)
        self.layout = KVLayout.from_config(self.config)
        self.rope_spec = RopeSpec.from_hf_config(self.config, cache_owner="transformers")
        if cache_budget_tokens < 1:
            raise InvalidRequestError(f"cache_budget_tokens: {cache_budget_tokens} must be >= 1")
        self.cache_budget_tokens = cache_budget_tokens
        cap = min(cache_budget_tokens + 1024, 8192)
        self.pool = KVPool(self.layout, self.rope_spec, self.dtype, self.device, capacity=cap)
        self.allocator = SlotAllocator(cap, grow=self.pool.grow)
        self.cache = PrefixCache(
            self.allocator, cache_budget_tokens, enabled=prefix_cache, pin_ttl_s=pin_ttl_s
        )
        self.runner = ModelRunner(model, self.pool, self.allocator)
        self.stepper = Stepper(self)
        self._stats: dict[str, EngineStats] = {}
        self._evicted_tokens = 0
        self._pin_evictions = 0
        ids = {tokenizer.convert_tokens_to_ids(t) for t in (IM_END, EOS)}
        ids |= set(_as_list(getattr(model.generation_config, "eos_token_id", None)))
        ids |= set(_as_list(tokenizer.eos_token_id))
        self.stop_token_ids = sorted(
            i for i in ids if isinstance(i, int) and 0 <= i < self.vocab_size
        )
        self.eos_token_id = tokenizer.eos_token_id
        self.message_boundary_id = tokenizer.convert_tokens_to_ids(IM_START)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        cache_budget_tokens: int = 65536,
        prefix_cache: bool = True,
        pin_ttl_s: float = 300.0,
    ) -> Engine:
        ld = load(path, dtype=dtype, device=device)
        return cls(
            ld.model,
            ld.tokenizer,
            model_name=ld.name,
            cache_budget_tokens=cache_budget_tokens,
            prefix_cache=prefix_cache,
            pin_ttl_s=pin_ttl_s,
        )

    # ------------------------------------------------------------------ rendering
    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
        *,
        where: str = "messages",
    ) -> list[int]:
        """The token ids of ``messages`` under the model's chat template (between steps:
        the tokenizer is shared with the step loop's detokenizer)."""
        with self.stepper.exclusive():
            return self._render(messages, tools, add_generation_prompt, where=where)

    def _render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
        *,
        where: str = "messages",
    ) -> list[int]:
        if not isinstance(messages, (list, tuple)):
            raise TrajectoryError(f"{where}: must be a list of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in _ROLES:
                raise TrajectoryError(f"{where}[{i}].role: must be one of {sorted(_ROLES)}")
            c = m.get("content")
            if c is not None and not isinstance(c, str):
                raise TrajectoryError(f"{where}[{i}].content: must be a string or null")
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # template errors: jinja raises many types
            raise TrajectoryError(f"{where}: the chat template cannot render them: {e}") from e
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_ids(self, ids: Sequence[int], where: str, allow_empty: bool = False) -> list[int]:
        if not allow_empty and len(ids) == 0:
            raise InvalidRequestError(f"{where}: must not be empty")
        out = []
        for k, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"{where}[{k}]: {t!r} is not a token id in [0, {self.vocab_size})"
                )
            out.append(t)
        return out

    # ------------------------------------------------------------------ generation
    def logits_for(
        self, prompt_ids: Sequence[int], *, namespace: Namespace = ANONYMOUS
    ) -> torch.Tensor:
        """Next-token logits of ``prompt_ids`` through the cache path (caches nothing)."""
        ids = self.check_ids(prompt_ids, "prompt_ids")
        with self.stepper.exclusive():
            m = self.cache.match(ids[:-1], namespace)
            self.cache.hold(m)
            try:
                return self.runner.logits_after(m.slots, ids[m.length :])
            finally:
                self.cache.release(m)

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        on_token: Callable[[int, str], None] | None = None,
        *,
        namespace: Namespace = ANONYMOUS,
    ) -> GenerationResult:
        """Generate in ``namespace``: it reuses exact rows of its tenant and its own spliced
        rows; what it computes after a spliced row is cached as its own (``radix.py``).

        Thread-safe: concurrent calls decode in one batched forward (``stepper.py``);
        ``on_token`` runs on the caller's thread, and if it raises, the request is dropped:
        its rows are freed, nothing is cached or counted."""
        params = params if params is not None else SamplingParams()
        params.validate()
        ids = self.check_ids(prompt_ids, "prompt_ids")
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit and len(ids) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the model's context of {limit} tokens"
            )
        extra_stop = self.check_ids(params.stop_token_ids, "stop_token_ids", allow_empty=True)
        stop_ids = frozenset(self.stop_token_ids) | frozenset(extra_stop)
        t0 = time.perf_counter()
        with self.stepper.exclusive():
            splice_lost = self.cache.arrive(namespace)
            m = self.cache.match(ids[:-1], namespace)
            self.cache.hold(m)
            seq = sequence.Sequence(
                prompt_ids=ids, params=params, namespace=namespace, match=m,
                sampler=Sampler(params, self.device), stopper=StopMatcher(list(params.stop)),
                stop_ids=stop_ids, t0=t0, splice_lost=splice_lost, on_token=on_token,
                logprobs=[] if params.logprobs else None,
            )  # fmt: skip
            seq.meta["flush"] = self.cache.enabled
            self.stepper.running.append(seq)
        try:
            self.stepper.drive(seq)
        except BaseException:
            with self.stepper.exclusive():
                self._abort(seq)
            raise
        with self.stepper.exclusive():
            return self._commit(seq)

    def _abort(self, seq: sequence.Sequence) -> None:
        """Drop a sequence: its rows are freed; nothing is cached or counted."""
        if seq in self.stepper.running:
            self.stepper.running.remove(seq)
        self.allocator.free(seq.fresh)
        seq.fresh = []
        self.cache.release(seq.match)

    def _commit(self, seq: sequence.Sequence) -> GenerationResult:
        m, ids, out, ns = seq.match, seq.prompt_ids, seq.output_ids, seq.namespace
        self.cache.release(m)
        if self.cache.enabled:
            exact = len(seq.token_ids) if m.exact_len == m.length else m.exact_len
            self.cache.insert(seq.token_ids, seq.slots, seq.fresh, ns, exact)
        else:
            self.allocator.free(seq.fresh)
        self.evict()
        st = self.counters(ns.tenant)
        st.requests += 1
        st.prompt_tokens += len(ids)
        st.cached_tokens += m.length
        st.prefilled_tokens += len(ids) - m.length
        st.generated_tokens += len(out)
        return GenerationResult(
            prompt_ids=ids,
            output_ids=out,
            text=seq.stopper.text,
            finish_reason=seq.finish_reason,
            prompt_tokens=len(ids),
            cached_tokens=m.length,
            prefilled_tokens=len(ids) - m.length,
            logprobs=seq.logprobs,
            ttft_s=seq.ttft_s,
            e2e_s=seq.e2e_s,
            splice_evicted=seq.splice_lost,
        )

    # ------------------------------------------------------------------ cache upkeep
    def counters(self, tenant: str) -> EngineStats:
        """The tenant's cumulative counters (created on first use)."""
        st = self._stats.get(tenant)
        if st is None:
            st = self._stats[tenant] = EngineStats()
        return st

    def evict(self) -> None:
        """Evict down to the budget; count evicted rows and splice results lost on the way."""
        rep = self.cache.evict()
        self._evicted_tokens += rep.evicted_tokens
        self._pin_evictions += rep.lost_pins

    # ------------------------------------------------------------------ directives
    def apply_directives(
        self, req: DirectivesRequest, *, namespace: Namespace | None = None
    ) -> DirectivesResponse:
        """``namespace`` defaults to the default tenant and ``req.session``."""
        from leyline_agent.engine.executor import apply_request

        ns = namespace if namespace is not None else Namespace(DEFAULT_TENANT, req.session)
        with self.stepper.exclusive():
            return apply_request(self, req, ns)

    def stats(self, tenant: str | None = None) -> StatsResponse:
        """Counters of one tenant (cache sizes: its own rows), or of the whole engine."""
        with self.stepper.exclusive():
            return self._stats_of(tenant)

    def _stats_of(self, tenant: str | None) -> StatsResponse:
        if tenant is None:
            parts = list(self._stats.values())
            cache_tokens, pinned = self.cache.total_tokens, self.cache.pins.pinned_tokens
            evicted, lost = self._evicted_tokens, self._pin_evictions
        else:
            parts = [self._stats[tenant]] if tenant in self._stats else []
            cache_tokens = self.cache.tenant_tokens(tenant)
            pinned = self.cache.pins.pinned_tokens_of(tenant)
            evicted, lost = self._evicted_tokens, self._pin_evictions
        total = EngineStats()
        for st in parts:
            for f in _COUNTERS:
                setattr(total, f, getattr(total, f) + getattr(st, f))
            for k, v in st.splices.items():
                total.splices[k] = total.splices.get(k, 0) + v
        return StatsResponse(
            requests=total.requests,
            prompt_tokens=total.prompt_tokens,
            cached_tokens=total.cached_tokens,
            prefilled_tokens=total.prefilled_tokens,
            generated_tokens=total.generated_tokens,
            splices=dict(total.splices),
            rotated_tokens=total.rotated_tokens,
            fallbacks=total.fallbacks,
            directive_errors=total.directive_errors,
            cache_tokens=cache_tokens,
            cache_capacity_tokens=self.cache_budget_tokens,
            evicted_tokens=evicted,
            pinned_tokens=pinned,
            pin_evictions=lost,
            tenant=tenant,
        )


_COUNTERS = (
    "requests", "prompt_tokens", "cached_tokens", "prefilled_tokens", "generated_tokens",
    "rotated_tokens", "fallbacks", "directive_errors",
)  # fmt: skip


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple, set)) else [x]
