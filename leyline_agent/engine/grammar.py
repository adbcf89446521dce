"""Grammar-constrained sampling with xgrammar: a token bitmask per step, batched.

Three levels, as in vLLM's and SGLang's structured output:

- ``Grammars`` (one per engine): the tokenizer's ``xgrammar.TokenizerInfo`` (built from the
  engine's own Hugging Face tokenizer, with the model's vocabulary size and the engine's
  stop tokens) and a ``GrammarCompiler``; ``constraint(spec)`` compiles a ``GrammarSpec``
  (cached by spec) and gives a fresh ``Constraint``;
- ``Constraint`` (one per sequence): a ``GrammarMatcher`` that accepts each sampled token;
- ``mask_logits`` (once per step): for the rows whose sequence has a constraint, the
  matchers fill one bitmask ``[rows, ceil(vocab / 32)]`` together (xgrammar's
  ``BatchGrammarMatcher``, on its threads) and ``apply_token_bitmask_inplace`` sets every
  token the grammar forbids to ``-inf`` in those rows only. Rows without a constraint are
  not touched.

When the grammar is complete, its mask allows only the stop tokens, so the sequence ends
on one of them (``finish_reason`` ``stop``); ``max_tokens`` can still cut it short
(``length``), as with any answer. Logprobs are those of the masked distribution.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from leyline_agent.engine.grammar_spec import GrammarPart, GrammarSpec
from leyline_agent.errors import InvalidRequestError

__all__ = ["Constraint", "Grammars", "mask_logits"]

CACHE_SPECS = 256  # compiled grammars kept per engine (xgrammar caches its own parts too)


class Constraint:
    """One sequence's grammar state: what it may write next, advanced token by token."""

    __slots__ = ("matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (the sampler chose it under this constraint's mask)."""
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} was sampled outside the grammar's mask")


class Grammars:
    """The engine's grammar compiler (thread-safe: requests compile outside the engine lock)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)
        self._compiled: dict[GrammarSpec, xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()

    def constraint(self, spec: GrammarSpec | None) -> Constraint | None:
        if spec is None:
            return None
        with self._lock:
            compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compile(spec)
            with self._lock:
                if len(self._compiled) >= CACHE_SPECS:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[spec] = compiled
        return Constraint(compiled)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            alts = [xgr.Grammar.concat(*map(_part, alt)) for alt in spec.alternatives]
            grammar = alts[0] if len(alts) == 1 else xgr.Grammar.union(*alts)
            return self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:  # xgrammar refuses the schema
            raise InvalidRequestError(f"{spec.field}: cannot constrain to it: {e}") from e


def _part(part: GrammarPart) -> xgr.Grammar:
    if part.kind == "text":
        return xgr.Grammar.from_ebnf("root ::= " + _ebnf_literal(part.value))
    if part.kind == "json_object":  # any object: free keys (strict off), compact spacing
        return xgr.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False
        )
    return xgr.Grammar.from_json_schema(part.value, any_whitespace=False, strict_mode=part.strict)


def _ebnf_literal(s: str) -> str:
    """``s`` as an EBNF string literal (xgrammar's escapes: ``\\"``, ``\\\\``, ``\\n``, ...)."""
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


class _Masks(threading.local):
    """A reusable bitmask buffer and batch matcher (the step thread's own)."""

    def __init__(self) -> None:
        self.bitmask: torch.Tensor | None = None
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)


_masks = _Masks()


def mask_logits(logits: torch.Tensor, constraints: Sequence[Constraint | None]) -> None:
    """Mask, in place, row ``i`` of ``logits`` ``[rows, vocab]`` by ``constraints[i]``'s
    grammar; rows whose constraint is None are left as they are."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return
    matchers = [constraints[i].matcher for i in rows]  # type: ignore[union-attr]
    n, vocab = len(constraints), logits.shape[-1]
    words = (vocab + 31) // 32
    bm = _masks.bitmask
    if bm is None or bm.shape[0] < n or bm.shape[1] != words:
        bm = _masks.bitmask = xgr.allocate_token_bitmask(max(n, 8), vocab)
    bitmask = bm[:n]
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(bitmask, rows[0])
    else:
        _masks.batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
    target = bitmask if logits.device.type == "cpu" else bitmask.to(logits.device)
    xgr.apply_token_bitmask_inplace(logits, target, vocab_size=vocab, indices=rows)
