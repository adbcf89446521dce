"""Rows of a spliced ``T'`` computed in place on vLLM's workers: REPAIR's, and ``R``'s.

After an AMORTIZE splice (``engine_ops`` ``splice``: the tail copied into fresh blocks, its
keys turned by ``delta``) the rows REPAIR selected (``directives.repair``) are forwarded again
under the edited context, through vLLM's own modules of the served model, layer by layer:

- layer 0's input is the rows' embeddings (``embed_tokens``); each layer's input norm,
  ``qkv_proj``, ``rotary_emb`` at the rows' positions in ``T'``, ``o_proj``, post-attention
  norm and MLP are the model's, with the residual carried as vLLM's decoder layer carries it;
- at each layer every selected row's K/V is written into its slot before any row attends,
  then each row attends to every row of ``T'`` at a position up to its own, read from the
  paged cache as whole blocks (``paged_rows.write_rows`` / ``read_sequence`` in the layer's row
  layout, the one the splice's row copies use, ``RowCopier.layout``):
  the prefix, ``R``, the tail rows before it (the selected ones already recomputed at this
  layer) and itself. That is what ``leyline serve``'s engine does (``engine.repair``): its
  runs of consecutive rows forwarded together, each run attending causally to itself.

A splice made without a head request computes ``R``'s rows the same way (they come first in
the rows, so a REPAIR's tail rows in the same run see them).

The caller writes only fresh slots of its splice (blocks nobody else reads yet) and checks
that before the first write. Only the Llama family's layers (``LlamaDecoderLayer``: llama,
mistral; SmolLM2 is one) are known here: any other model is refused by ``repair_problem``,
which the route asks before it runs a REPAIR directive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from leyline_agent.kernels.paged_rows import RowLayout, read_sequence, write_rows

if TYPE_CHECKING:
    from vllm.model_executor.models.llama import LlamaAttention

__all__ = ["LAYER_TYPES", "RowForward", "repair_problem"]

LAYER_TYPES = frozenset({"LlamaDecoderLayer"})  # decoder layers whose forward is known here


def _layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    return list(getattr(inner, "layers", None) or [])


def repair_problem(model: nn.Module) -> str | None:
    """Why REPAIR's row forward cannot run on ``model`` (a sentence that starts with the
    setting to change), or None when it can."""
    layers = _layers(model)
    kinds = sorted({type(layer).__name__ for layer in layers})
    if not layers or not set(kinds) <= LAYER_TYPES:
        return (
            f"model_type: REPAIR recomputes rows through vLLM's {sorted(LAYER_TYPES)} only; "
            f"this model's layers are {kinds or type(model).__name__} (use amortize or forget)"
        )
    if not hasattr(model.model, "embed_tokens"):
        return "pipeline_parallel_size: REPAIR needs the embeddings on every worker"
    for layer in layers:
        attn = layer.self_attn.attn
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding_window: REPAIR's row forward attends over every earlier row"
        kv = getattr(attn, "kv_cache", None)
        if not isinstance(kv, torch.Tensor) or kv.dim() != 4:
            return "kv_cache_layout: an attention layer holds no 4-d paged KV cache"
    return None


class RowForward:
    """The row forward of one worker's model (module doc)."""

    def __init__(self, model: nn.Module, layout: RowLayout) -> None:
        self.model, self._layout = model, layout  # the layers' row layout (``RowCopier``)

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], rows: Sequence[int], blocks: Sequence[int]) -> int:
        """Recompute the K/V of ``rows`` (positions in ``T'``, sorted, distinct; their tokens
        ``token_ids``) in place. ``blocks``: ``T'``'s blocks in order, through the one that
        holds ``max(rows)`` (row ``p`` at slot ``blocks[p // N] * N + p % N``). Returns the
        number of rows written."""
        if not rows:
            return 0
        if len(token_ids) != len(rows) or list(rows) != sorted(set(rows)):
            raise ValueError("rows must be sorted, distinct, one token id each")
        layers = _layers(self.model)
        kv0 = layers[0].self_attn.attn.kv_cache
        dev, b = kv0.device, int(kv0.shape[2])
        if rows[-1] >= len(blocks) * b:
            raise ValueError(f"row {rows[-1]} has no slot ({len(blocks)} blocks of {b} given)")
        pos = torch.tensor(list(rows), dtype=torch.int64, device=dev)
        ctx = torch.tensor(list(blocks), dtype=torch.int64, device=dev)
        row_slots = ctx[pos // b] * b + pos % b
        # row i attends to the context rows at positions <= its own: every row sees all of
        # them before the first row's position (``hidden``: the rest, from there on)
        hidden = torch.arange(rows[0] + 1, rows[-1] + 1, device=dev)[None, :] > pos[:, None]
        m = rows[-1] + 1  # context rows read at each layer, counted here (no device read)
        h = self.model.model.embed_tokens(torch.tensor(list(token_ids), device=dev))
        residual = None
        for k, layer in enumerate(layers):
            if residual is None:
                residual, x = h, layer.input_layernorm(h)
            else:
                x, residual = layer.input_layernorm(h, residual)
            last = k == len(layers) - 1
            x = self._attention(layer.self_attn, pos, x, row_slots, ctx, m, hidden, last)
            if last:
                break  # the last layer's K/V are written: nothing reads its output
            x, residual = layer.post_attention_layernorm(x, residual)
            h = layer.mlp(x)
        return len(rows)

    def _attention(
        self,
        sa: LlamaAttention,
        pos: torch.Tensor,
        x: torch.Tensor,
        row_slots: torch.Tensor,
        ctx: torch.Tensor,
        m: int,
        hidden: torch.Tensor,
        write_only: bool,
    ) -> torch.Tensor:
        """One attention block for the rows: their K/V written at ``row_slots``, then each
        row's attention over the first ``m`` rows of ``T'`` in the blocks ``ctx`` (through the
        last row's position; ``hidden``: those it may not see among the last ``W`` of them,
        ``[n, W]``; every row sees the others).
        Grouped-query: each KV head serves its query heads as one batch, with no copy of the
        keys per query head."""
        n = x.shape[0]
        attn = sa.attn
        nh, kvh, hd = sa.num_heads, sa.num_kv_heads, sa.head_dim
        qkv, _ = sa.qkv_proj(x)
        q, k, v = qkv.split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
        q, k = sa.rotary_emb(pos, q.contiguous(), k.contiguous())
        kv = attn.kv_cache
        write_rows(kv, row_slots, k.reshape(n, kvh, hd), v.reshape(n, kvh, hd), self._layout)
        if write_only:
            return x
        keys, values = read_sequence(kv, ctx, m, self._layout)  # [kvh, M, hd]: whole blocks
        rep = nh // kvh
        qg = q.reshape(n, kvh, rep, hd).permute(1, 0, 2, 3).reshape(kvh, n * rep, hd).float()
        scores = torch.bmm(qg, keys.float().transpose(1, 2)).mul_(sa.scaling)
        scores = scores.view(kvh, n, rep, m)
        scores[..., m - hidden.shape[1] :].masked_fill_(hidden[None, :, None, :], -torch.inf)
        probs = torch.softmax(scores.view(kvh, n * rep, m), dim=-1)
        out = torch.bmm(probs, values.float()).view(kvh, n, rep, hd)
        o, _ = sa.o_proj(out.permute(1, 0, 2, 3).reshape(n, nh * hd).to(x.dtype))
        return o
