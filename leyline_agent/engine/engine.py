"""The embedded engine: transformers model + KV pool + radix prefix cache + splices.

Engine facade. Thread-safe: concurrent ``generate`` calls share batched steps
(``stepper.py``); every other operation runs between two steps, under the engine lock (but
a directive's prefills, which are steps themselves).

- ``generate``: longest cached prefix (at most ``len(prompt) - 1`` tokens: the last prompt
  token is always recomputed for its logits), prefill the rest, decode, then cache
  ``prompt + output`` (the last output token is forwarded once more so the whole sequence,
  which the agent's next turn repeats, is in the cache).
- ``apply_directives``: execute a token-form or message-form request (``executor.py``): the
  checks, the plan and the cache writes run between steps; ``R``'s prefill runs in the step
  loop beside the other sequences (``Stepper.prefill``).
- ``stats``: cumulative counters per tenant (``wire.Counters``; ``StatsResponse`` on the wire),
  evicted rows and lost splice results included, each counted for the tenant whose rows
  they were.
- ``stop_generations``: make every generation fail at its next token (a server's shutdown
  deadline). After a generation, freed memory is handed back to the OS (``memory.py``), and
  when the engine goes idle the KV pool shrinks back towards its first capacity if the top of
  it is free (``_shrink_pool``): a burst of long prompts does not hold its rows' memory for
  good.
"""

from __future__ import annotations

import copy
import importlib.util
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from leyline_agent.directives.checks import check_token_ids
from leyline_agent.directives.compile import render
from leyline_agent.directives.repair import DEFAULT_BUDGET, DEFAULT_SELECTOR, SELECTORS
from leyline_agent.engine import sequence
from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.cache.kv_pool import KVLayout, KVPool
from leyline_agent.engine.cache.prefix_cache import FlushReport, PrefixCache
from leyline_agent.engine.detokenizer import Detokenizer
from leyline_agent.engine.executor import EngineDirectives, apply_request
from leyline_agent.engine.memory import MemoryTrimmer
from leyline_agent.engine.model.loader import load
from leyline_agent.engine.model.runner import ModelRunner
from leyline_agent.engine.params import GenerationResult, SamplingParams
from leyline_agent.engine.sampler import Sampler
from leyline_agent.engine.stepper import Stepper
from leyline_agent.errors import InvalidRequestError, RuntimeUnavailableError
from leyline_agent.families import chat_format, token_id
from leyline_agent.namespaces import ANONYMOUS, DEFAULT_TENANT, Namespace
from leyline_agent.wire import Counters, DirectivesRequest, DirectivesResponse, StatsResponse

__all__ = ["Engine", "GenerationResult", "GenerationStopped", "SamplingParams"]

log = structlog.get_logger(__name__)
_GRAMMARS_LOCK = threading.Lock()  # an engine's grammar compiler is built once
SHRINK_INTERVAL_S = 1.0  # the KV pool looks for a free top at most this often (idle)


class GenerationStopped(RuntimeUnavailableError):
    """A generation ended by ``Engine.stop_generations`` (the server is shutting down).
    ``retry_after_s``: the ``Retry-After`` of its 503 (a restarted server, or another
    replica, can take the request)."""

    retry_after_s = 5


class Engine:
    # Concurrent calls are safe (see the module doc): the server's worker may run several
    # requests at once on it (``server.worker.ServedEngine``).
    thread_safe = True
    # It masks its sampling by a request's grammar (``SamplingParams.grammar``; xgrammar).
    supports_grammar = importlib.util.find_spec("xgrammar") is not None

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str = "leyline",
        cache_budget_tokens: int = 65536,
        prefix_cache: bool = True,
        pin_ttl_s: float = 300.0,
        packed_linears: bool = True,
        tenant_cache_share: float | None = None,
        repair_budget: float = DEFAULT_BUDGET,
        repair_selector: str = DEFAULT_SELECTOR,
    ) -> None:
        from leyline_agent.kernels import RopeSpec

        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self._render_local = threading.local()  # a tokenizer per rendering thread
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(self.config.vocab_size)
        self.layout = KVLayout.from_config(self.config)
        self.rope_spec = RopeSpec.from_hf_config(self.config, cache_owner="transformers")
        if cache_budget_tokens < 1:
            raise InvalidRequestError(f"cache_budget_tokens: {cache_budget_tokens} must be >= 1")
        self.cache_budget_tokens = cache_budget_tokens
        if not 0.0 <= repair_budget <= 1.0:
            raise InvalidRequestError(f"repair_budget: {repair_budget} is not in [0, 1]")
        self.repair_budget = repair_budget
        if repair_selector not in SELECTORS:
            raise InvalidRequestError(
                f"repair_selector: {repair_selector!r} is not one of {sorted(SELECTORS)}"
            )
        self.repair_selector = repair_selector
        cap = min(cache_budget_tokens + 1024, 8192)
        self.pool = KVPool(self.layout, self.rope_spec, self.dtype, self.device, capacity=cap)
        self.allocator = SlotAllocator(cap, grow=self.pool.grow)
        self._first_capacity, self._last_shrink = cap, 0.0
        try:
            self.cache = PrefixCache(
                self.allocator, cache_budget_tokens, enabled=prefix_cache, pin_ttl_s=pin_ttl_s,
                tenant_share=tenant_cache_share,
            )  # fmt: skip
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        self.runner = ModelRunner(model, self.pool, self.allocator, packed_linears=packed_linears)
        self.stepper = Stepper(self)
        self._counters: dict[str, Counters] = {}
        self._stopped: str | None = None  # why generations stop (stop_generations)
        self.memory = MemoryTrimmer()
        self._grammars: Any = None  # engine/grammar.py's Grammars, from the first grammar
        chat = chat_format(self.config.model_type)
        ids = {token_id(tokenizer, t) for t in chat.stop_tokens}
        ids |= set(_as_list(getattr(model.generation_config, "eos_token_id", None)))
        ids |= set(_as_list(tokenizer.eos_token_id))
        self.stop_token_ids = sorted(
            i for i in ids if isinstance(i, int) and 0 <= i < self.vocab_size
        )
        self.eos_token_id = tokenizer.eos_token_id
        self.message_boundary_id = token_id(tokenizer, chat.message_boundary)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        cache_budget_tokens: int = 65536,
        prefix_cache: bool = True,
        pin_ttl_s: float = 300.0,
        packed_linears: bool = True,
        tenant_cache_share: float | None = None,
        repair_budget: float = DEFAULT_BUDGET,
        repair_selector: str = DEFAULT_SELECTOR,
    ) -> Engine:
        ld = load(path, dtype=dtype, device=device)
        return cls(
            ld.model,
            ld.tokenizer,
            model_name=ld.name,
            cache_budget_tokens=cache_budget_tokens,
            prefix_cache=prefix_cache,
            pin_ttl_s=pin_ttl_s,
            packed_linears=packed_linears,
            tenant_cache_share=tenant_cache_share,
            repair_budget=repair_budget,
            repair_selector=repair_selector,
        )

    # ------------------------------------------------------------------ rendering
    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
        *,
        where: str = "messages",
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of ``messages`` under the model's chat template; ``template_kwargs``:
        more arguments of ``apply_chat_template``. Runs beside the step loop, not under the
        engine lock: a huge prompt's tokenization (0.2-1 s for 280 KB) then holds no other
        tenant's steps. Each thread renders with its own copy of the tokenizer
        (``_render_tokenizer``), since the step loop's detokenizers share ``tokenizer``."""
        return render(
            self._render_tokenizer(), messages, tools, add_generation_prompt, where=where,
            template_kwargs=template_kwargs,
        )  # fmt: skip

    def _render_tokenizer(self) -> Any:
        """This thread's copy of the tokenizer (made on its first render: about 10 ms). A fast
        tokenizer's Rust object is not to be used by two threads at once. The copy reads its
        settings (``init_kwargs``: the tool setting, ``tool_prompt.set_setting``) from the
        served tokenizer's own dict, so a setting changed after the copy was made reaches
        every thread's renders."""
        tok = getattr(self._render_local, "tokenizer", None)
        if tok is None:
            with self.stepper.exclusive():  # the copy reads the shared tokenizer
                tok = copy.deepcopy(self.tokenizer)
                tok.init_kwargs = self.tokenizer.init_kwargs
                self._render_local.tokenizer = tok
        return tok

    def check_ids(self, ids: Sequence[int], where: str, allow_empty: bool = False) -> list[int]:
        return check_token_ids(ids, self.vocab_size, where, allow_empty=allow_empty)

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
        if self._stopped is not None:
            raise GenerationStopped(self._stopped)
        on_token = self._stoppable(on_token)
        own = frozenset() if params.ignore_eos else frozenset(self.stop_token_ids)
        stop_ids = own | frozenset(extra_stop)
        constraint = self._constraint(params, stop_ids)  # compiled outside the engine lock
        t0 = time.perf_counter()
        with self.stepper.exclusive():
            splice_lost = self.cache.arrive(namespace, ids)
            m = self.cache.match(ids[:-1], namespace)
            self.cache.hold(m)
            seq = sequence.Sequence(
                prompt_ids=ids, params=params, namespace=namespace, match=m,
                sampler=Sampler(params, self.device, constraint, prompt_ids=ids, stop_ids=stop_ids),
                detok=Detokenizer(self.tokenizer, params.stop),
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
                self._shrink_pool()
            self.memory.after_request(idle=not self.stepper.running)
            raise
        with self.stepper.exclusive():
            result = self._commit(seq)
            self._shrink_pool()
        self.memory.after_request(idle=not self.stepper.running)  # outside the lock
        return result

    def _constraint(self, params: SamplingParams, stop_ids: frozenset[int]) -> Any:
        """The grammar state of a constrained request (``engine/grammar.py``; the compiler is
        built on the first one), None for a free one."""
        if params.grammar is None:
            return None
        with _GRAMMARS_LOCK:
            if self._grammars is None:
                from leyline_agent.engine.grammar import Grammars

                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._grammars.constraint(params.grammar, stop_ids)

    def flush(self, tenant: str) -> FlushReport:
        """Empty ``tenant``'s part of the cache (``PrefixCache.flush``) under the engine lock,
        then give the memory back: the free top of the KV pool at once (``_shrink_pool``
        without its interval) and the allocator's free pages (``MemoryTrimmer.trim_now``,
        outside the lock). Memory that the requests before the flush freed (a huge prompt's
        tokenization, refused bodies) then leaves the resident size instead of waiting in
        glibc's arenas for the next generation's trim."""
        with self.stepper.exclusive():
            rep = self.cache.flush(tenant)
            self._shrink_pool(now=True)
        self.memory.trim_now()
        return rep

    def _shrink_pool(self, *, now: bool = False) -> None:
        """Under the lock, when no sequence is running and at most half the pool is in use:
        give back the free top of the pool, down to its first capacity (at most once per
        ``SHRINK_INTERVAL_S`` unless ``now``: finding the top is O(capacity)). Rows in use
        keep their slots."""
        cap = self.pool.capacity
        if self.stepper.running or cap <= self._first_capacity:
            return
        if self.allocator.num_used > cap // 2:
            return
        t = time.monotonic()
        if not now and t - self._last_shrink < SHRINK_INTERVAL_S:
            return
        self._last_shrink = t
        self.pool.shrink(self.allocator.trim(self._first_capacity))

    def stop_generations(self, reason: str = "the server is shutting down") -> None:
        """From now on every generation, running or yet to start, fails with
        ``GenerationStopped`` at its next token, or before its next prefill chunk (a long
        prompt stops between two chunks: ``Stepper.halt``), dropped like any failed request:
        nothing cached or counted; a splice's replacement prefill fails the same way (the
        cache is left as it was). A server's shutdown deadline calls it so requests end
        instead of running on; it cannot be undone."""
        self._stopped = reason
        self.stepper.halt(GenerationStopped(reason))

    def _stoppable(self, on_token: Callable[[int, str], None] | None) -> Callable[[int, str], None]:
        def checked(token: int, delta: str) -> None:
            if self._stopped is not None:
                raise GenerationStopped(self._stopped)
            if on_token is not None:
                on_token(token, delta)

        return checked

    def _abort(self, seq: sequence.Sequence) -> None:
        """Drop a sequence: its rows are freed; nothing is cached or counted."""
        if seq in self.stepper.running:
            self.stepper.running.remove(seq)
        self.allocator.free(seq.fresh + seq.reserved)
        seq.fresh, seq.reserved = [], []
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
        self.counters(ns.tenant).count_generation(len(ids), m.length, len(out))
        return GenerationResult(
            prompt_ids=ids,
            output_ids=out,
            text=seq.detok.text,
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
    def counters(self, tenant: str) -> Counters:
        """The tenant's cumulative counters (created on first use)."""
        st = self._counters.get(tenant)
        if st is None:
            st = self._counters[tenant] = Counters()
        return st

    def evict(self) -> None:
        """Evict down to the budget; count evicted rows and splice results lost on the way,
        each for the tenant whose rows they were (not the one whose request evicted them)."""
        rep = self.cache.evict()
        for tenant, n in rep.evicted_by_tenant.items():
            self.counters(tenant).evicted_tokens += n
        for tenant, n in rep.lost_pins_by_tenant.items():
            self.counters(tenant).pin_evictions += n

    # ------------------------------------------------------------------ directives
    def apply_directives(
        self, req: DirectivesRequest, *, namespace: Namespace | None = None
    ) -> DirectivesResponse:
        """Execute ``req`` on the cache (``executor.py``); ``namespace`` defaults to the default
        tenant and ``req.session``. (The pure T' of a batch is ``directives.splice_tokens``.)"""
        ns = namespace if namespace is not None else Namespace(DEFAULT_TENANT, req.session)
        return apply_request(self, req, ns)  # R's prefill runs in the step loop

    @property
    def directive_backend(self) -> EngineDirectives:
        """This engine as ``directives.service``'s backend (run it in a worker thread)."""
        return EngineDirectives(self)

    def stats(self, tenant: str | None = None) -> StatsResponse:
        """Counters of one tenant (cache sizes: its own rows), or of the whole engine."""
        with self.stepper.exclusive():
            return self._stats_of(tenant)

    def _stats_of(self, tenant: str | None) -> StatsResponse:
        if tenant is None:
            parts = list(self._counters.values())
            cache_tokens, pinned = self.cache.total_tokens, self.cache.pins.pinned_tokens
        else:
            parts = [self._counters[tenant]] if tenant in self._counters else []
            cache_tokens = self.cache.tenant_tokens(tenant)
            pinned = self.cache.pins.pinned_tokens_of(tenant)
        return Counters.total(parts).to_stats(
            cache_tokens=cache_tokens,
            cache_capacity_tokens=self.cache_budget_tokens,
            cache_share_tokens=self.cache.share_tokens,
            pinned_tokens=pinned,
            tenant=tenant,
        )


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple, set)) else [x]
