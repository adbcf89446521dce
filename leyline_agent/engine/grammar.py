"""Grammar-constrained sampling with xgrammar: one token bitmask per step, batched.

Three levels, as in vLLM's and SGLang's structured outputs:

- ``Grammars`` (one per engine): an ``xgrammar.TokenizerInfo`` built from the engine's own
  Hugging Face tokenizer, with the model's vocabulary size (the logits' width, which may be
  larger than the tokenizer's) and the engine's stop tokens, and a ``GrammarCompiler``
  (which caches what it compiled, by schema); ``constraint(spec, stop_ids)`` compiles a
  ``GrammarSpec`` and gives a fresh ``Constraint``. A schema or tag the compiler refuses is
  an ``InvalidRequestError`` naming the spec's field, and so is one whose compile takes
  longer than ``compile_deadline_s`` (``COMPILE_DEADLINE_S``; some schemas compile in time
  quadratic in their size: 600 optional properties take 10 s here). Compiles run on
  ``COMPILE_THREADS`` threads of their own; one past its deadline finishes there in the
  background (its result is cached), the request waiting on it is refused.
- ``Constraint`` (one per sequence): a ``GrammarMatcher`` that accepts each sampled token.
  Its stop tokens are the sequence's own (the engine's and the request's ``stop_token_ids``):
  once the grammar is complete the mask allows only them, so a finished answer ends there
  (``finish_reason`` ``stop``). ``max_tokens`` or a stop string can still cut an answer
  short, as any answer (``length``: the JSON is then incomplete, as OpenAI's would be).
- ``mask_logits`` (once per step, on the step thread under the engine lock): the matchers of
  the constrained rows fill one bitmask ``[rows, ceil(vocab / 32)]`` together
  (``BatchGrammarMatcher``, on xgrammar's threads) and ``apply_token_bitmask_inplace`` sets
  every token their grammar forbids to ``-inf`` in those rows only: rows without a
  constraint are not touched. Logprobs are then those of the masked distribution (what was
  sampled from).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import xgrammar as xgr

from leyline_agent.engine.grammar_spec import GrammarSpec
from leyline_agent.errors import InvalidRequestError

__all__ = ["Constraint", "GrammarViolation", "Grammars", "check_spec", "mask_logits"]

COMPILER_CACHE_BYTES = 256 << 20  # what xgrammar's compiler keeps of compiled grammars
MASK_THREADS = 2  # xgrammar's threads filling a batch's bitmask
MIN_MASK_ROWS = 8  # the bitmask buffer is grown, never shrunk, from this many rows
COMPILE_DEADLINE_S = 5.0
COMPILE_THREADS = 2
_COMPILES = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="leyline-grammar")


class GrammarViolation(RuntimeError):
    """A token was sampled that the grammar's mask forbade (a bug, never the client's)."""


class Constraint:
    """One sequence's grammar state: what it may write next, advanced token by token."""

    __slots__ = ("grammars", "matcher")

    def __init__(self, grammars: Grammars, matcher: xgr.GrammarMatcher) -> None:
        self.grammars, self.matcher = grammars, matcher

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (chosen under this constraint's mask)."""
        if self.matcher.is_terminated():
            return  # the stop token was accepted: the sequence ends on it
        if not self.matcher.accept_token(token_id):
            raise GrammarViolation(f"token {token_id} was sampled outside the grammar's mask")

    @property
    def complete(self) -> bool:
        """The answer so far is a whole match (only a stop token may follow)."""
        return self.matcher.is_completed()


def check_spec(spec: GrammarSpec) -> None:
    """Raise ``InvalidRequestError`` naming ``spec.field`` if xgrammar refuses ``spec``.

    Tokenizer-free (no engine needed), so a server checks a request's grammar before it
    edits or splices anything; ``Grammars.compile`` raises the same error."""
    with _refused(spec):
        if spec.kind == "json_schema":
            _schema_ebnf(spec.value)
        elif spec.kind == "structural_tag":
            _tag_grammar(spec.value)


@functools.lru_cache(maxsize=256)
def _tag_grammar(tag_json: str) -> xgr.Grammar:
    return xgr.Grammar.from_structural_tag(_compact_tag(tag_json))


class Grammars:
    """The engine's grammar compiler and its step's bitmask buffer."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        compile_deadline_s: float = COMPILE_DEADLINE_S,
    ) -> None:
        self.vocab_size = vocab_size
        self.compile_deadline_s = compile_deadline_s
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(
            self.info, max_threads=2, cache_limit_bytes=COMPILER_CACHE_BYTES
        )
        self.batch = xgr.BatchGrammarMatcher(max_threads=MASK_THREADS)
        self.bitmask = xgr.allocate_token_bitmask(MIN_MASK_ROWS, vocab_size)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """``spec`` compiled (thread-safe; a request compiles before it enters the engine),
        within ``compile_deadline_s``."""
        future = _COMPILES.submit(self._compile, spec)
        try:
            return future.result(timeout=self.compile_deadline_s)
        except FutureTimeout:
            future.cancel()  # still queued: never runs
            raise InvalidRequestError(
                f"cannot constrain the answer to it: its grammar did not compile within "
                f"{self.compile_deadline_s:g} s",
                spec.field,
            ) from None

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        with _refused(spec):
            if spec.kind == "json_schema":  # compact JSON: (", ", ": "), no free whitespace
                compiled = self.compiler.compile_grammar(_schema_ebnf(spec.value))
            elif spec.kind == "json_object":  # any keys: strict mode off
                compiled = self.compiler.compile_grammar(_schema_ebnf('{"type": "object"}', False))
            else:
                compiled = self.compiler.compile_structural_tag(_compact_tag(spec.value))
        return compiled

    def constraint(self, spec: GrammarSpec, stop_token_ids: Iterable[int]) -> Constraint:
        matcher = xgr.GrammarMatcher(
            self.compile(spec), override_stop_tokens=sorted(stop_token_ids)
        )
        return Constraint(self, matcher)

    def rows(self, n: int) -> torch.Tensor:
        """A bitmask buffer of at least ``n`` rows (grown, never shrunk)."""
        if self.bitmask.shape[0] < n:
            self.bitmask = xgr.allocate_token_bitmask(
                max(n, 2 * self.bitmask.shape[0]), self.vocab_size
            )
        return self.bitmask


@contextlib.contextmanager
def _refused(spec: GrammarSpec) -> Iterator[None]:
    """xgrammar's refusal of ``spec`` as an ``InvalidRequestError`` naming its field."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidRequestError(f"cannot constrain the answer to it: {msg}", spec.field) from e


def _compact_tag(tag_json: str) -> str:
    """A structural tag whose plain JSON-schema parts are written as the JSON-schema
    compiler writes them: compact (``", "``, ``": "``, no other whitespace) and with no raw
    control character in a string. xgrammar's own structural-tag JSON parts allow free
    whitespace and raw control characters in strings (invalid JSON a parser refuses)."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        plain = (
            set(node) <= {"type", "json_schema", "style"} and node.get("style", "json") == "json"
        )
        if node.get("type") == "json_schema" and plain and "json_schema" in node:
            return {"type": "grammar", "grammar": _schema_ebnf(json.dumps(node["json_schema"]))}
        return {k: walk(v) for k, v in node.items()}

    try:
        tag = json.loads(tag_json)
    except ValueError:
        return tag_json  # the compiler says what is wrong with it
    return json.dumps(walk(tag), ensure_ascii=False)


# What xgrammar's JSON-schema converter writes for one character of a string with a
# ``minLength``/``maxLength``: it lets raw control characters through (invalid JSON); its
# other string rules exclude them (``[^\0-\x1f...]``), and so does this one once patched.
_COUNTED_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = r"[^\0-\x1f\"\\\r\n]"


@functools.lru_cache(maxsize=256)
def _schema_ebnf(schema_json: str, strict: bool = True) -> str:
    """The EBNF of a JSON schema's compact JSON (strings free of raw control characters)."""
    ebnf = str(xgr.Grammar.from_json_schema(schema_json, any_whitespace=False, strict_mode=strict))
    return ebnf.replace(_COUNTED_CHAR, _JSON_CHAR)


def mask_logits(logits: torch.Tensor, constraints: Sequence[Constraint | None]) -> None:
    """Mask, in place, row ``i`` of ``logits`` ``[rows, vocab]`` by ``constraints[i]``;
    rows whose constraint is None are left as they are."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return
    if len(constraints) != logits.shape[0]:
        raise ValueError(f"{len(constraints)} constraints for {logits.shape[0]} rows of logits")
    matchers = [constraints[i].matcher for i in rows]  # type: ignore[union-attr]
    grammars = constraints[rows[0]].grammars  # type: ignore[union-attr]
    bitmask = grammars.rows(len(constraints))
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(bitmask, rows[0])
    else:
        grammars.batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    vocab = min(grammars.vocab_size, logits.shape[-1])
    with torch.inference_mode():  # the runner's logits are inference tensors
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
        if logits.shape[-1] > vocab:  # columns past the grammar's vocabulary: never a token
            logits[rows, vocab:] = float("-inf")
